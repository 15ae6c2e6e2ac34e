"""Writing one whole file to a backend: the interface every backend's uploads implement.

A :class:`FileUpload` receives a file's bytes as a sequence of buffers and makes the file
appear only when :meth:`FileUpload.commit` succeeds; on error, :meth:`FileUpload.abort` removes
what was started (a temporary file, a pending multipart upload). Buffers handed to ``write``
may be views of tensor memory: an upload copies them at most once. Each backend's own uploads
live with the backend (:mod:`~dcp_fsspec.storage.backends`): local disk (temporary name, fsync, rename), S3
(concurrent multipart parts within a :class:`ByteBudget`), SFTP (temporary name, rename), and
fsspec's buffered file everywhere else.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterable

import fsspec

from dcp_fsspec.storage.format.crc import crc32

# S3 rejects multipart parts under 5 MiB (except the last).
MIN_PART_SIZE = 5 * 1024 * 1024


class ByteBudget:
    """A counting semaphore in bytes: how much upload data may be in flight at once."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        # A request larger than the whole budget proceeds alone rather than deadlocking.
        n = min(n, self._limit)
        with self._cond:
            self._cond.wait_for(lambda: self._used + n <= self._limit)
            self._used += n

    def release(self, n: int) -> None:
        n = min(n, self._limit)
        with self._cond:
            self._used -= n
            self._cond.notify_all()


class FileUpload(abc.ABC):
    """Base class: the bytes of one file, published on :meth:`commit`."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs = fs
        self.path = path
        self.size = 0

    @abc.abstractmethod
    def write(self, buffers: Iterable[bytes | memoryview]) -> None:
        """Append ``buffers`` to the file (may block while earlier parts upload)."""

    def write_checksummed(self, data: memoryview) -> int:
        """Append ``data`` like :meth:`write` and return its CRC-32 (a tensor record's checksum).

        Uploads that checksum their request bodies anyway (S3) compute it in that same pass.
        """
        crc = crc32(data, 0)
        self.write([data])
        return crc

    def start_writeback(self) -> None:
        """Start moving what was written so far to durable storage, without waiting for it.

        A hint for long writes, so the closing :meth:`commit` has less left to wait for.
        Uploads that send their bytes as they go have nothing to do.
        """

    @abc.abstractmethod
    def commit(self) -> None:
        """Publish the file under its final name; after this it is complete or absent."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard what was written; the final name is left untouched."""


def publish_whole(upload: FileUpload, buffers: Iterable[bytes | memoryview]) -> None:
    """Write ``buffers`` through ``upload`` and commit it; abort it if anything fails."""
    try:
        upload.write(buffers)
        upload.commit()
    except BaseException:
        upload.abort()
        raise
