"""An fsspec filesystem over obstore, for the code that asks a Location's ``fs`` directly.

obstore's own fsspec class raises obstore's exceptions, which are not ``OSError``s (absence
aside). Here each call raises the built-in type they mean (``PermissionError``,
``FileExistsError``, ``OSError``), so the wrapping every layer does applies unchanged. The
backend (:mod:`~dcp_fsspec.storage.backends.obstore_backend`) uses obstore's calls directly.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import obstore.exceptions as obx
from obstore.fsspec import FsspecStore

from dcp_fsspec.storage.backends.obstore_options import AZURE_SCHEMES, S3_SCHEMES, azure_options, s3_options

T = TypeVar("T")

# obstore's exception → the built-in type it means; the rest become OSError.
_BUILT_IN: tuple[tuple[type[BaseException], type[OSError]], ...] = (
    (obx.PermissionDeniedError, PermissionError),
    (obx.UnauthenticatedError, PermissionError),
    (obx.AlreadyExistsError, FileExistsError),
    (obx.PreconditionError, FileExistsError),
)


def as_os_error(error: BaseException) -> BaseException:
    """``error`` as the built-in exception it means (obstore's are not ``OSError``s); the
    message is its first line, without the server's whole answer."""
    if isinstance(error, OSError) or not isinstance(error, obx.BaseError):
        return error
    cls = next((b for o, b in _BUILT_IN if isinstance(error, o)), OSError)
    return cls(str(error).split("\n", 1)[0])


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

    @staticmethod
    def from_options(url: str, storage_options: dict[str, Any]) -> ObstoreFileSystem:
        """The filesystem of ``url``'s scheme, for ``storage_options`` as users pass them to its
        fsspec driver (s3fs, adlfs)."""
        scheme = url.split("://", 1)[0]
        if scheme in AZURE_SCHEMES:
            return ObstoreAzureFileSystem(**azure_options(url, storage_options))
        return ObstoreS3FileSystem(**s3_options(url, storage_options))

    def store(self, path: str) -> tuple[Any, str]:
        """The obstore store of ``path``'s bucket, and the key in it."""
        bucket, key = self._split_path(path)
        return self._construct_store(bucket), key

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
