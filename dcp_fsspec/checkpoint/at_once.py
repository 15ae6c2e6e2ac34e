"""Independent calls sent together: a small save's or load's time is its round trips, not its bytes.

A save of a small state on S3 is a handful of requests that need not wait for each other (the
pointer, the iteration's commit record and listing, each key's ``.metadata``, each key's files):
sent together, they cost one round trip instead of one each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# At most this many calls run at once; more wait for a free thread.
MAX_AT_ONCE = 16


def at_once(calls: Sequence[Callable[[], Any]], *, name: str) -> list[Any]:
    """Run every call, side by side, and return their results in order.

    The first call runs on the calling thread, the others on threads of their own (one call
    starts no thread). Every call finishes before anything is raised; then the first failure,
    in the order of ``calls``, is raised.

    Args:
        calls: the calls, independent of each other.
        name: the threads' name prefix (``dcp-fsspec-{name}``), for stack dumps and profiles.
    """
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(max_workers=min(len(calls) - 1, MAX_AT_ONCE), thread_name_prefix=f"dcp-fsspec-{name}") as pool:
        others = [pool.submit(call) for call in calls[1:]]
        try:
            first: list[Any] = [calls[0]()]
        except BaseException as e:  # noqa: BLE001 - raised once the others finished, as theirs are
            first_error: BaseException | None = e
            first = []
        else:
            first_error = None
    if first_error is not None:
        raise first_error
    return first + [future.result() for future in others]
