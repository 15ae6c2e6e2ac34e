"""An fsspec filesystem over obstore, its errors as built-in ones, and its requests tried.

obstore raises its own exceptions, which are not ``OSError``s (absence aside). Here each call
raises the built-in type they mean (``PermissionError``, ``FileExistsError``,
``ConnectionError``, ``OSError`` with the HTTP status), so the wrapping every layer does
applies unchanged.

The backend (:mod:`~dcp_fsspec.storage.backends.obstore_backend`) calls obstore directly, on
stores with obstore's own retries off (:meth:`ObstoreFileSystem.store`): obstore would retry
throttling out of our sight. :func:`tried` tries each request a few times instead, as botocore
does under s3fs, and reports every throttled answer to the store's limiter at once, so the
requests in flight drop. The caller's RetryPolicy retries on top, as on every store.
"""

from __future__ import annotations

import asyncio
import functools
import random
import re
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import obstore.exceptions as obx
from obstore.fsspec import FsspecStore
from obstore.store import from_url

from dcp_fsspec.storage.backends.obstore_options import AZURE_SCHEMES, S3_SCHEMES, azure_options, s3_options
from dcp_fsspec.storage.transport.concurrency import throttled_now
from dcp_fsspec.storage.transport.retry import is_throttling, is_transient

T = TypeVar("T")

# obstore's own retries, off: each call here sends one request.
NO_RETRIES: dict[str, Any] = {"max_retries": 0}
# obstore's retries of a multipart upload's parts, which no caller can resend one by one.
# obstore draws each wait between init_backoff and ``base`` times the one before: at its
# default base of 2 the waits hardly grow (ten retries in under 3 s), at 4 they double on average.
PART_RETRIES: dict[str, Any] = {
    "max_retries": 10,
    "backoff": {"init_backoff": timedelta(seconds=0.1), "max_backoff": timedelta(seconds=15), "base": 4},
    "retry_timeout": timedelta(seconds=180),
}
# Tries of one request here, and the backoff between them (full jitter, doubling).
ATTEMPTS = 5
BASE_DELAY = 0.1
MAX_DELAY = 5.0

# obstore's exception → the built-in type it means; the rest become OSError.
_BUILT_IN: tuple[tuple[type[BaseException], type[OSError]], ...] = (
    (obx.PermissionDeniedError, PermissionError),
    (obx.UnauthenticatedError, PermissionError),
    (obx.AlreadyExistsError, FileExistsError),
    (obx.PreconditionError, FileExistsError),
)
# object_store's errors carry no status field, only their text: an answer with an error
# status, the request's method, and a request that got no answer (connect, send, body, timeout).
_STATUS = re.compile(r"Server returned non-2xx status code: (\d{3})\b")
_METHOD = re.compile(r"Error performing ([A-Z]+) ")
_NO_ANSWER = "HTTP error: "


def as_os_error(error: BaseException) -> BaseException:
    """``error`` as the built-in exception it means (obstore's are not ``OSError``s); the
    message is its first line, without the server's whole answer.

    An error status goes on the error as ``status``, and the method as ``operation_name``:
    the attributes :mod:`~dcp_fsspec.storage.transport.retry` reads on drivers' errors
    (``503`` and ``429`` are throttling). A request that got no answer is a ``ConnectionError``.
    """
    if isinstance(error, OSError) or not isinstance(error, obx.BaseError):
        return error
    line = str(error).split("\n", 1)[0]
    built_in = next((b for o, b in _BUILT_IN if isinstance(error, o)), None)
    if built_in is not None:
        return built_in(line)
    status = _STATUS.search(line)
    mapped = ConnectionError(line) if status is None and _NO_ANSWER in line else OSError(line)
    if status is not None:
        mapped.status = int(status.group(1))  # type: ignore[attr-defined]
    method = _METHOD.search(line)
    if method is not None:
        mapped.operation_name = method.group(1)  # type: ignore[attr-defined]
    return mapped


def tried(fn: Callable[[], T]) -> T:
    """``fn()`` (obstore calls), tried up to :data:`ATTEMPTS` times; fails as a built-in error."""
    for attempt in range(ATTEMPTS):
        try:
            return fn()
        except obx.BaseError as e:
            time.sleep(_delay_after(e, attempt))
    raise AssertionError("unreachable")  # pragma: no cover - _delay_after raises on the last


async def tried_async(make: Callable[[], Awaitable[T]]) -> T:
    """``await make()`` (an obstore call), tried as :func:`tried` tries."""
    for attempt in range(ATTEMPTS):
        try:
            return await make()
        except obx.BaseError as e:
            await asyncio.sleep(_delay_after(e, attempt))
    raise AssertionError("unreachable")  # pragma: no cover - _delay_after raises on the last


def _delay_after(error: obx.BaseError, attempt: int) -> float:
    """The seconds before the next try of a request that failed with ``error``; raises the
    built-in error where there is none to make."""
    mapped = as_os_error(error)
    if is_throttling(mapped):
        throttled_now()
    if attempt + 1 >= ATTEMPTS or not is_transient(mapped):
        raise mapped from error
    return random.uniform(0, min(MAX_DELAY, BASE_DELAY * 2**attempt))


def _mapped(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(method)
    async def call(*args: Any, **kwargs: Any) -> T:
        try:
            return await method(*args, **kwargs)
        except obx.BaseError as e:
            raise as_os_error(e) from e

    return call


class ObstoreFileSystem(FsspecStore):  # type: ignore[misc]
    """A store through obstore (``storage_options={"transport": "obstore", …}``): one subclass
    per store, named by its URL schemes."""

    protocol: tuple[str, ...] = ()
    # What selects the backend (storage/backends/__init__.py), whatever the protocol.
    dcp_fsspec_transport = "obstore"

    def __init__(self, *, config: dict[str, Any], client_options: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(self.protocol[0], config=config, client_options=client_options, **kwargs)
        # A bucket's stores, each holding its client's connections: one for the backend's
        # requests (obstore's retries off), one for the parts of multipart uploads.
        self.bucket_store = functools.lru_cache(maxsize=None)(functools.partial(self._new_store, NO_RETRIES))
        self.parts_store = functools.lru_cache(maxsize=None)(functools.partial(self._new_store, PART_RETRIES))

    @staticmethod
    def from_options(url: str, storage_options: dict[str, Any]) -> ObstoreFileSystem:
        """The filesystem of ``url``'s scheme, for ``storage_options`` as users pass them to its
        fsspec driver (s3fs, adlfs)."""
        scheme = url.split("://", 1)[0]
        if scheme in AZURE_SCHEMES:
            return ObstoreAzureFileSystem(**azure_options(url, storage_options))
        return ObstoreS3FileSystem(**s3_options(url, storage_options))

    def store(self, path: str) -> tuple[Any, str]:
        """The store of ``path``'s bucket, with obstore's retries off, and the key in it: the
        caller retries each call under its RetryPolicy."""
        bucket, key = self._split_path(path)
        return self.bucket_store(bucket), key

    def _new_store(self, retries: dict[str, Any], bucket: str) -> Any:
        # obstore's __init__ set the instance's protocol to the scheme it was given.
        scheme = self.protocol if isinstance(self.protocol, str) else self.protocol[0]
        return from_url(
            url=f"{scheme}://{bucket}",
            config=self._config,
            client_options=self._client_options,
            retry_config=retries,
            credential_provider=self._credential_provider,
            **self._config_kwargs,
        )

    _cat_file = _mapped(FsspecStore._cat_file)
    _pipe_file = _mapped(FsspecStore._pipe_file)

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        info: dict[str, Any] = await _mapped(FsspecStore._info)(self, path, **kwargs)
        # obstore names a file by its key alone; fsspec's name holds the bucket too.
        return {**info, "name": self._strip_protocol(path).rstrip("/")}

    _ls = _mapped(FsspecStore._ls)
    _rm_file = _mapped(FsspecStore._rm_file)
    _cp_file = _mapped(FsspecStore._cp_file)
    _put_file = _mapped(FsspecStore._put_file)
    _get_file = _mapped(FsspecStore._get_file)


class ObstoreS3FileSystem(ObstoreFileSystem):
    protocol = S3_SCHEMES


class ObstoreAzureFileSystem(ObstoreFileSystem):
    protocol = AZURE_SCHEMES
