"""fsyncs of finished local files, run on threads of their own and waited for together.

A save whose commit is a record written later (a :class:`~dcp_fsspec.Checkpointer`'s keys)
needs its files durable before that record, not before the next file is written. Handing each
finished file's fsync to a thread lets the writing thread go on to the next key while the disk
flushes the last one: a small save of four keys on local disk writes them one after another
(four key threads contending for the GIL cost more CPU than they hid) and overlaps every flush
with the next key's planning instead.

The files are renamed into place before their fsync (a file written through one is renamed at
once, as an object store publishes it): only the caller's commit, after :meth:`FileSyncs.wait`,
makes them part of a checkpoint, so a power loss before it leaves nothing that anything names.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import BinaryIO

from dcp_fsspec.errors import StorageError
from dcp_fsspec.storage.transport.workers import Workers


class FileSyncs:
    """Fsyncs and closes the files handed to it on the process's ``fsync`` threads (up to
    ``threads`` of them, kept between saves, see :mod:`~dcp_fsspec.storage.transport.workers`).

    The writers of one save share it (any thread may hand files over); the save calls
    :meth:`wait` once, before it relies on the files (fsyncs their folders, writes its commit).
    """

    def __init__(self, threads: int) -> None:
        self._workers = Workers("fsync", max(1, threads))
        self._pending: list[tuple[str, Future[None]]] = []

    def submit(self, file: BinaryIO, url: str) -> None:
        """Fsync ``file`` (the file of ``url``), then close it; this object owns it from now on."""
        self._pending.append((url, self._workers.submit(_sync_and_close, file)))

    def wait(self, *, raise_errors: bool = True) -> None:
        """Return once every file handed over is fsynced and closed (none is given up: each
        is closed, whatever happens to the others).

        Raises:
            StorageError: a file's fsync failed (naming its URL; the first such file), unless
                ``raise_errors`` is false (a caller already raising an error of its own).
        """
        pending, self._pending = self._pending, []
        errors = [(url, done.exception()) for url, done in pending]  # waits for every one
        for url, error in errors:
            if error is not None and raise_errors:
                raise StorageError(
                    f"cannot write {url}: its fsync failed ({error}), so the disk never confirmed it; "
                    "check the disk and its free space, then save again"
                ) from error


def _sync_and_close(file: BinaryIO) -> None:
    try:
        os.fsync(file.fileno())
    finally:
        file.close()
