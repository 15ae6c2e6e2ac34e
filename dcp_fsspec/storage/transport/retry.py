"""Retrying storage calls that failed for a passing reason, within a bounded time.

fsspec drivers already retry: s3fs repeats a call up to 5 times on dropped connections, timeouts
and ``503 SlowDown``, each over botocore's own 5 attempts for 5xx and throttling (so a
never-clearing ``SlowDown`` surfaces only after many requests and tens of seconds; ``500
InternalError`` gets botocore's attempts only, which s3fs itself does not retry). What they do
not give is a bound on the time one call may take, nor one place to set the limits. A
:class:`RetryPolicy` adds both around every storage call of a save or load (each part upload,
ranged read, metadata, commit record and pointer write): a few more attempts, with exponential
backoff and full jitter, after the driver gave up on a *transient* error, and a deadline per
call that cancels an attempt still running on an async filesystem (s3fs, gcsfs, adlfs).

:func:`is_transient` is the one classification: throttling, 5xx and dropped connections are
transient; everything else (403, 404, bad credentials, a bad request, a local disk error) is
permanent, is never retried by this layer, and reaches the caller unchanged and at once.
Where the caller gives an :class:`~dcp_fsspec.storage.transport.concurrency.AdaptiveLimit`,
each attempt waits for a place under it, and throttling lowers it (``RetryPolicy.adaptive``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from dcp_fsspec.errors import DcpFsspecError, StorageError
from dcp_fsspec.storage.transport.concurrency import AdaptiveLimit, Ticket, running
from dcp_fsspec.storage.transport.driver_errors import is_network_error

T = TypeVar("T")

# 501 Not Implemented is a 5xx that no retry will change.
_PERMANENT_5XX = {501, 505}
_TRANSIENT_4XX = {408, 429}
# Error codes object stores use for throttling and server trouble, whatever the status says.
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
}
# The codes and statuses that mean "too many requests": the store asks for fewer.
_THROTTLING_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
}
_THROTTLING_STATUSES = {429, 503}
# Built-in types that say what is wrong with the request, not with the network.
_PERMANENT_TYPES = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    KeyError,
    NotImplementedError,
    DcpFsspecError,
)


@dataclass(frozen=True)
class RetryPolicy:
    """How storage calls are retried when they fail for a passing reason.

    Args:
        attempts: tries of one call in all, the first included (on top of the driver's own
            retries); 1 turns retries off here.
        base_delay: seconds before the first retry; each retry waits up to twice as long as the
            one before (a random fraction of it: "full jitter", so that ranks and threads that
            failed together do not retry together).
        max_delay: the longest wait between two tries, in seconds.
        deadline: the most seconds one call may take, its retries included; an attempt still
            running then is cancelled where the filesystem is async. ``None``: no limit.
        adaptive: lower the requests sent at once to a store that throttles, and raise them
            back slowly after (S3 uploads and ranged reads); False keeps them as configured.
    """

    attempts: int = 4
    base_delay: float = 0.2
    max_delay: float = 5.0
    deadline: float | None = 120.0
    adaptive: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(
                f"RetryPolicy delays must be >= 0, got base_delay={self.base_delay}, max_delay={self.max_delay}"
            )
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"RetryPolicy.deadline must be > 0 seconds or None, got {self.deadline}")

    @property
    def enabled(self) -> bool:
        return self.attempts > 1 or self.deadline is not None

    def call(self, fn: Callable[[], T], *, url: str) -> T:
        """``fn()``, retried; the deadline is checked between attempts (``fn`` is not interrupted)."""
        return self._retry(lambda _remaining: fn(), url)

    def run(self, fs: fsspec.AbstractFileSystem, method: str, *args: Any, url: str, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)``, retried.

        On an async filesystem each attempt gets fsspec's own ``timeout=`` (the time left before
        the deadline), which cancels the request on the event loop when it runs out.
        """
        call = getattr(fs, method)
        if self.deadline is not None and getattr(fs, "async_impl", False):
            return self._retry(lambda remaining: call(*args, timeout=remaining, **kwargs), url)
        return self.call(lambda: call(*args, **kwargs), url=url)

    async def call_async(
        self,
        make: Callable[[], Awaitable[T]],
        *,
        url: str,
        kind: str = "",
        limit: AdaptiveLimit | None = None,
    ) -> T:
        """``await make()``, retried; an attempt still running at the deadline is cancelled.

        Args:
            make: one attempt.
            url: what the call is about, for the error.
            kind: the request's kind (``GET``, ``PUT``), for the error where the driver's does not say.
            limit: the store's requests at once; each attempt waits for a place under it
                (with ``adaptive``), and throttling lowers it.
        """
        limit = limit if self.adaptive else None
        if not self.enabled and limit is None:
            return await make()
        tries = _Tries(self, url, kind)
        for remaining in tries:
            try:
                return await _attempt(make, remaining, limit, tries)
            except Exception as e:  # noqa: BLE001 - classified by is_transient, re-raised if permanent
                await asyncio.sleep(tries.failed(e))
        raise AssertionError("unreachable")  # pragma: no cover - _Tries.failed raises when done

    def _retry(self, attempt: Callable[[float | None], T], url: str) -> T:
        """``attempt(seconds left)`` until it succeeds, fails for good, or the policy runs out."""
        if not self.enabled:
            return attempt(None)
        tries = _Tries(self, url)
        for remaining in tries:
            witness = Ticket()  # notes throttling the driver retried by itself (s3fs's hook)
            try:
                with running(witness):
                    return attempt(remaining)
            except Exception as e:  # noqa: BLE001 - classified by is_transient, re-raised if permanent
                tries.throttled = tries.throttled or witness.throttled
                time.sleep(tries.failed(e))
        raise AssertionError("unreachable")  # pragma: no cover - _Tries.failed raises when done


NO_RETRY = RetryPolicy(attempts=1, deadline=None)
DEFAULT_RETRY = RetryPolicy()


async def _attempt(
    make: Callable[[], Awaitable[T]], remaining: float | None, limit: AdaptiveLimit | None, tries: _Tries
) -> T:
    """One attempt, under ``limit`` where there is one: throttling seen during it lowers the limit."""
    if limit is None:
        return await asyncio.wait_for(make(), remaining)
    ticket = await asyncio.wait_for(limit.acquire(), remaining)
    try:
        with running(ticket):
            return await asyncio.wait_for(make(), remaining)
    except Exception as e:
        if is_throttling(e):
            ticket.throttle()
        raise
    finally:
        tries.throttled = tries.throttled or ticket.throttled
        limit.release(ticket)


class _Tries:
    """One call's attempts: yields the seconds left for each; decides after each failure."""

    def __init__(self, policy: RetryPolicy, url: str, kind: str = "") -> None:
        self.policy = policy
        self.url = url
        self.kind = kind
        self.start = time.monotonic()
        self.count = 0
        self.throttled = False  # the store throttled an attempt (its own error, or the driver's retries)

    def __iter__(self) -> Iterator[float | None]:
        while True:
            self.count += 1
            yield self._remaining()

    def _remaining(self) -> float | None:
        if self.policy.deadline is None:
            return None
        return max(self.policy.deadline - (time.monotonic() - self.start), 0.001)

    def failed(self, error: Exception) -> float:
        """The seconds to wait before the next attempt; raises when there is none to make."""
        if not is_transient(error):
            raise error
        policy = self.policy
        elapsed = time.monotonic() - self.start
        delay = random.uniform(0, min(policy.max_delay, policy.base_delay * 2 ** (self.count - 1)))
        out_of_time = policy.deadline is not None and elapsed + delay >= policy.deadline
        if self.count < policy.attempts and not out_of_time:
            return delay
        why = (
            f"the {policy.deadline:g} s deadline passed"
            if out_of_time
            else f"all {policy.attempts} attempts failed"
        )
        if self.throttled or is_throttling(error):
            raise self._throttled_error(error, elapsed, why) from error
        timed_out = isinstance(error, TimeoutError) and not str(error)
        last = (
            "the last attempt was still running"
            if timed_out
            else f"last error: {type(error).__name__}: {error}"
        )
        raise StorageError(
            f"giving up on {self.url} after {self.count} attempt(s) in {elapsed:.1f} s: {why} with "
            f"transient errors (throttling, server errors or dropped connections); {last}. Check that "
            "the storage is reachable, or allow more with RetryPolicy(attempts=..., deadline=...)"
        ) from error

    def _throttled_error(self, error: Exception, elapsed: float, why: str) -> StorageError:
        """One line: the store, the request kind, and what to do about throttling that never cleared."""
        kind = request_kind(error) or self.kind or "its"
        return StorageError(
            f"giving up on {self.url} after {self.count} attempt(s) in {elapsed:.1f} s: the store "
            f"throttled {kind} requests (503 SlowDown) until {why}. Lower the request rate (fewer "
            "ranks writing or reading under one prefix, or fewer files per rank), allow more time "
            "with RetryPolicy(deadline=..., attempts=...), or ask the provider for a higher limit"
        )


def is_throttling(error: BaseException) -> bool:
    """Whether ``error`` is the store asking for fewer requests (``503 SlowDown``, 429)."""
    return any(is_throttling_answer(*http_status(cause)) for cause in causes(error))


def is_throttling_answer(status: int | None, code: str | None) -> bool:
    """Whether an HTTP answer's status and error code ask for fewer requests."""
    return code in _THROTTLING_CODES or status in _THROTTLING_STATUSES


def request_kind(error: BaseException) -> str | None:
    """The operation a driver's error names (botocore's ``operation_name``: ``UploadPart``)."""
    for cause in causes(error):
        name = getattr(cause, "operation_name", None)
        if isinstance(name, str) and name:
            return name
    return None


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` may go away if the call is repeated (throttling, 5xx, a dropped connection).

    Looks through the chain of causes, where drivers keep the HTTP response (s3fs turns a
    ``503 SlowDown`` into ``OSError(EBUSY)`` caused by botocore's ``ClientError``).
    """
    if isinstance(error, _PERMANENT_TYPES):
        return False
    for cause in causes(error):
        status, code = http_status(cause)
        if code in _TRANSIENT_CODES:
            return True
        if status is not None:
            return status in _TRANSIENT_4XX or (status >= 500 and status not in _PERMANENT_5XX)
        if isinstance(cause, (ConnectionError, TimeoutError)) or is_network_error(cause):
            return True
    return False


def http_status(error: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and error code a driver's exception carries, where it carries them.

    botocore's ``ClientError`` has them in ``response``; aiohttp, gcsfs and the Azure SDK put
    the status in ``status``, ``code`` or ``status_code``.
    """
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = response.get("Error", {}).get("Code")
        return (status if isinstance(status, int) else None), (code if isinstance(code, str) else None)
    for name in ("status", "status_code", "code"):
        value = getattr(error, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value, None
    return None, None


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or while handling, outermost first."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
