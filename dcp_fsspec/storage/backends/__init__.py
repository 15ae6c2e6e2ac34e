"""What differs between storage backends, decided once per filesystem from one table.

Every layer above the storage layer asks a :class:`~dcp_fsspec.storage.backends.base.Backend` (``location.backend``) what
the store can do and how. Nothing else in the package tests a filesystem's type, protocol or
private API. The contract (:mod:`~dcp_fsspec.storage.backends.base`) is a small core and optional capabilities with defaults.

A backend is chosen by the filesystem's fsspec protocol from :data:`BACKENDS` (module path and
class name, imported on first use, like fsspec's own registry). A protocol missing from the
table gets the generic :class:`~dcp_fsspec.storage.backends.generic.FsspecBackend` (documented in the README as "other
fsspec backends"). Adding a backend is one table entry and the module holding its quirks (S3's
are spread over ``s3*.py``, one concern each).

A filesystem may name its transport instead (``dcp_fsspec_transport``): s3:// through obstore
(``storage_options={"transport": "obstore"}``, :func:`filesystem_for`) is the ``obstore`` entry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.registry import known_implementations

from dcp_fsspec.errors import MissingDriverError
from dcp_fsspec.storage.backends.base import Backend, RangeReader, Versioned
from dcp_fsspec.storage.backends.generic import FsspecBackend
from dcp_fsspec.storage.backends.obstore_options import TRANSPORT_OPTION, transport_of
from dcp_fsspec.storage.transport.retry import NO_RETRY, RetryPolicy

# fsspec protocol → "module:Class" under this package.
BACKENDS: dict[str, str] = {
    "file": "local:LocalBackend",
    "local": "local:LocalBackend",
    "s3": "s3:S3Backend",
    "s3a": "s3:S3Backend",
    "sftp": "sftp:SftpBackend",
    "ssh": "sftp:SftpBackend",
    "memory": "memory:MemoryBackend",
    # Not a protocol: the transport a filesystem names (see the module's docstring).
    "obstore": "obstore_backend:ObstoreBackend",
}

# URL scheme → the pip package that provides its fsspec driver, for the error users see.
DRIVER_PACKAGES: dict[str, str] = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "sftp": "sshfs",
    "ssh": "sshfs",
    "hf": "huggingface_hub",
    "oci": "ocifs",
    "oss": "ossfs",
}


def filesystem_for(
    url: str, storage_options: dict[str, Any], shown: str
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of ``url``: fsspec's driver, or obstore where
    ``storage_options["transport"]`` asks for it (that option never reaches a driver).

    Args:
        url: the URL, credentials included.
        storage_options: the user's options for the driver.
        shown: ``url`` as messages may show it.

    Raises:
        InvalidURLError: an unknown transport, or an option obstore cannot honour.
        MissingDriverError: obstore was asked for and is not installed.
    """
    options = dict(storage_options)
    if transport_of(shown, options) == "fsspec":
        options.pop(TRANSPORT_OPTION, None)
        return fsspec.core.url_to_fs(url, **options)  # type: ignore[no-any-return]
    try:
        from dcp_fsspec.storage.backends.obstore_filesystem import ObstoreFileSystem
    except ImportError as e:
        raise MissingDriverError(
            f"cannot open {shown!r} with transport='obstore': obstore is not installed; "
            "run `pip install 'dcp-fsspec[obstore]'`, or drop the transport option"
        ) from e
    fs = ObstoreFileSystem.from_options(shown, options)
    return fs, fs._strip_protocol(url)


def backend_for(
    fs: fsspec.AbstractFileSystem, retry: RetryPolicy = NO_RETRY, url_of: Callable[[str], str] | None = None
) -> Backend:
    """The backend for ``fs`` (its first protocol that the table knows; else :class:`FsspecBackend`).

    Args:
        fs: the filesystem.
        retry: how its calls are retried.
        url_of: how messages spell a path (a Location's, so they show the URL the user wrote).
    """
    transport = getattr(fs, "dcp_fsspec_transport", None)
    for protocol in (transport,) if transport else _protocols_of(fs):
        entry = BACKENDS.get(protocol)
        if entry is not None:
            module_name, class_name = entry.split(":")
            cls: type[Backend] = getattr(importlib.import_module(f"{__name__}.{module_name}"), class_name)
            if cls.accepts(fs):
                return cls(fs, retry, url_of)
    return FsspecBackend(fs, retry, url_of)


def _protocols_of(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    """``fs``'s protocols; from fsspec's table of implementations where the class does not say.

    Some drivers (sshfs) leave ``protocol = "abstract"`` and rely on fsspec's registry to set it
    when the class is looked up by scheme; a filesystem unpickled in another process (DCP's
    process executor) has a class that was imported directly, and still says "abstract".
    """
    declared = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if declared not in (("abstract",), ()):
        return declared
    name = f"{type(fs).__module__}.{type(fs).__qualname__}"
    return tuple(p for p, spec in known_implementations.items() if spec.get("class") == name)


__all__ = [
    "BACKENDS",
    "DRIVER_PACKAGES",
    "Backend",
    "FsspecBackend",
    "RangeReader",
    "Versioned",
    "backend_for",
    "filesystem_for",
]
