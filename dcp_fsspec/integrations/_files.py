"""Whole files at a URL, for the integrations: the framework's own small files (Lightning's
``meta.pt``, a ``.ckpt``, the Hugging Face Trainer's JSON state) written complete-or-absent
through our backends, read back, found and deleted, with the same storage options and retry
policy as the DCP data beside them.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import posixpath
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsspec.errors import CheckpointNotFoundError, MissingDriverError
from dcp_fsspec.storage.backends.uploads import ByteBudget, publish_whole
from dcp_fsspec.storage.transport.error_wrapping import storage_errors, unwrap_dcp
from dcp_fsspec.storage.transport.gc_pause import collector_paused
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, RetryPolicy
from dcp_fsspec.storage.transport.urls import Location, resolve

if TYPE_CHECKING:
    from dcp_fsspec.storage.read.reader import FsspecStorageReader

MiB = 1024 * 1024


def require(module: str, extra: str, integration: str) -> ModuleType:
    """Import a framework for an integration, or say in one line which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDriverError(
            f"{integration} needs the {module.partition('.')[0]} package, which is not installed: "
            f"run `pip install 'dcp-fsspec[{extra}]'`"
        ) from e


def locate(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None,
    retry: RetryPolicy | None = DEFAULT_RETRY,
) -> Location:
    """``url`` resolved with ``storage_options`` (see :func:`dcp_fsspec.storage.transport.urls.resolve`)."""
    return resolve(url, storage_options, retry=retry)


def child(where: Location, *names: str) -> Location:
    """The location of ``names`` below ``where`` (same filesystem and retry policy)."""
    path = where.join(*names)
    return dataclasses.replace(where, path=path, url=where.url_of(path), secret_url="")


def write_file(where: Location, data: bytes | memoryview, *, part_size: int = 16 * MiB) -> None:
    """Write ``data`` as the file at ``where``: complete or absent (one upload, published whole)."""
    backend = where.backend
    backend.make_folder(posixpath.dirname(where.path))
    with storage_errors("write", where.url):
        upload = backend.new_upload(where.path, part_size=part_size, budget=ByteBudget(4 * part_size))
        publish_whole(upload, [data])
    backend.invalidate(posixpath.dirname(where.path))


def read_file(where: Location) -> bytes:
    """The bytes of the file at ``where``.

    Raises:
        CheckpointNotFoundError: there is no file there.
        StorageError: the backend failed.
    """
    try:
        data: bytes = where.backend.call("cat_file", where.path)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"no checkpoint file at {where.url}: check the path") from e
    return data


def exists(where: Location) -> bool:
    """Whether anything (file or folder) is at ``where``; listings are read afresh."""
    where.backend.invalidate(posixpath.dirname(where.path))
    return bool(where.backend.call("exists", where.path))


def remove(where: Location) -> None:
    """Delete the file or folder at ``where``, if there is one."""
    if exists(where):
        where.backend.call("rm", where.path, recursive=True)
        where.backend.invalidate(posixpath.dirname(where.path))


def is_dcp_checkpoint(where: Location) -> bool:
    """Whether ``where`` is a committed DCP checkpoint (its ``.metadata`` is written last)."""
    return exists(child(where, ".metadata"))


def unwrapped(call: Callable[[], Any], action: str, *, reader: FsspecStorageReader | None = None) -> Any:
    """``call()`` (a ``dcp.save``/``dcp.load``, or waiting for an async save), with DCP's per-rank
    ``CheckpointException`` turned into one of our errors (on a load, a failure we do not
    recognise means the checkpoint does not fit the model)."""
    try:
        return call()
    except CheckpointException as e:
        failure = reader.metadata_failure if reader is not None else None
        raise unwrap_dcp(e, action, mismatch=reader is not None, metadata_failure=failure) from e


def blocking(call: Callable[[], Any], action: str, *, reader: FsspecStorageReader | None = None) -> Any:
    """A synchronous ``dcp.save``/``dcp.load``, as :func:`unwrapped`, with the cyclic garbage
    collector paused for the whole call on the main thread (:mod:`dcp_fsspec.storage.transport.gc_pause`).

    The writer's and reader's own pauses do not cover DCP's planning or the broadcast of its
    metadata, whose objects live until the call returns; on several ranks they set off a full
    collection on the coordinator at every save. A framework's save or load is one call we make,
    so the pause can span it and still end when it fails."""
    with collector_paused():
        return unwrapped(call, action, reader=reader)
