"""The generic backend: the core over any fsspec filesystem, with only what fsspec's API promises.

A protocol missing from :data:`~dcp_fsspec.storage.backends.BACKENDS` gets :class:`FsspecBackend`: fsspec's buffered
writer, ranged ``cat_file`` reads, one ``pipe_file`` for small files, and small-file updates
serialized within one process. Local disk, S3 and SFTP refine it.
"""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import fsspec

from dcp_fsspec.errors import DcpFsspecError, StorageError
from dcp_fsspec.storage.backends.base import Backend, InPlaceFiles, Versioned
from dcp_fsspec.storage.backends.uploads import MIN_PART_SIZE, ByteBudget, FileUpload
from dcp_fsspec.storage.transport.file_syncs import FileSyncs


class FsspecBackend(Backend):
    """Any fsspec filesystem that publishes a written file whole on close and applies
    ``pipe_file`` atomically (object stores)."""

    # --- the core ---------------------------------------------------------------------------

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def read_versioned(self, path: str) -> Versioned:
        self.invalidate(self.fs._parent(path))
        try:
            return Versioned(self.call("cat_file", path))
        except FileNotFoundError:
            return Versioned(None)

    def new_upload(
        self,
        path: str,
        *,
        part_size: int,
        budget: ByteBudget,
        fsync: bool = True,
        multipart_threshold: int = 0,
        syncs: FileSyncs | None = None,
    ) -> FileUpload:
        """fsspec's buffered file, which object stores publish on close; it relies on the
        driver's retries."""
        return BufferedUpload(self.fs, path, block_size=max(part_size, MIN_PART_SIZE))

    def find(self, path: str, *, withdirs: bool = False) -> dict[str, dict[str, Any]]:
        """fsspec's ``find``, in one recursive listing (one request per 1,000 files on S3).

        It skips folders it fails to read: a caller that acts on an absence confirms it with a
        call that raises on failure.
        """
        self.invalidate(path)
        try:
            return dict(self.call("find", path, withdirs=withdirs, detail=True))
        except FileNotFoundError:
            return {}

    def remove_files(self, paths: Sequence[str], *, within: str) -> None:
        """One ``rm`` of the whole list (drivers that have a bulk delete use it), then one by
        one if some were absent."""
        paths = [p for p in paths if self.remove_link(p, within) is None]
        if paths:
            try:
                self.retry.run(self.fs, "rm", list(paths), url=self.url_of(within))
            except FileNotFoundError:
                for path in paths:
                    self._rm_if_present(path)
            except DcpFsspecError:
                raise
            except OSError as e:
                raise StorageError(
                    f"cannot delete {len(paths)} file(s) under {self.url_of(within)}: {e}"
                ) from e
        self.invalidate(within)

    def replace_if_unchanged(self, path: str, data: bytes, expected: Versioned) -> bool:
        """A plain atomic write: the caller's :meth:`exclusive` makes the read and the write one step."""
        self.write_small_atomic(path, data)
        return True

    # --- where fsspec has a cheaper way than the defaults -----------------------------------

    def write_small_atomic(
        self,
        path: str,
        data: bytes,
        *,
        fsync: bool = True,
        sync_folder: bool = True,
        syncs: FileSyncs | None = None,
    ) -> None:
        """One ``pipe_file``, which object stores apply whole."""
        self.call("pipe_file", path, data)
        self.invalidate(self.fs._parent(path))

    def folder_exists(self, path: str) -> bool:
        """One ``info`` rather than a recursive listing."""
        self.invalidate(posixpath.dirname(path))
        try:
            self.call("info", path)
        except FileNotFoundError:
            return False
        return True

    def remove_trees(self, paths: Sequence[str], *, within: str) -> None:
        """One recursive ``rm`` a path."""
        for path in paths:
            if self.remove_link(path, within) is None:
                self._rm_if_present(path, recursive=True)
        self.invalidate(within)

    def _rm_if_present(self, path: str, *, recursive: bool = False) -> None:
        try:
            self.call("rm", path, recursive=recursive)
        except FileNotFoundError:
            pass  # already gone

    @property
    def async_reads(self) -> bool:
        return bool(getattr(self.fs, "async_impl", False)) and getattr(self.fs, "loop", None) is not None

    async def read_range_async(self, path: str, start: int, end: int) -> bytes | bytearray:
        return await self.fs._cat_file(path, start=start, end=end)

    async def read_range_into_async(self, path: str, start: int, view: memoryview) -> int:
        """Fill ``view`` with the bytes of ``path`` from ``start``, on the event loop, for
        :class:`LoopFiles`: the bytes read, fewer only where the file ends (here: read, then
        copy; S3 reads into it)."""
        data = await self.read_range_async(path, start, start + len(view))
        view[: len(data)] = data
        return len(data)

    def in_place_files(self) -> InPlaceFiles | None:
        """On the event loop where :attr:`async_reads`, else none."""
        return LoopFiles(self) if self.async_reads else None


class LoopFiles(InPlaceFiles):
    """:class:`InPlaceFiles` of a store read on its filesystem's event loop (S3, GCS, Azure).

    Each call blocks its (pool) thread while the read runs on the loop, retried by the backend's
    policy; a retried read fills the same memory again from its first byte.
    """

    backend: FsspecBackend

    def __init__(self, backend: FsspecBackend) -> None:
        super().__init__(backend)
        self.fs = backend.fs
        self._sizes: dict[str, int] = {}

    def _run(self, path: str, make: Callable[[], Any]) -> Any:
        call = self.backend.retry.call_async(make, url=self.backend.url_of(path))
        return asyncio.run_coroutine_threadsafe(call, self.fs.loop).result()

    def read(self, path: str, size: int, offset: int) -> bytes:
        return bytes(self._run(path, lambda: self.backend.read_range_async(path, offset, offset + size)))

    def size(self, path: str) -> int:
        if path not in self._sizes:  # s3fs answers from the listing the load's preflight made
            self._sizes[path] = int(self.backend.call("info", path)["size"])
        return self._sizes[path]

    def read_into(self, path: str, offset: int, view: memoryview) -> int:
        return int(self._run(path, lambda: self.backend.read_range_into_async(path, offset, view)))


class BufferedUpload(FileUpload):
    """fsspec's buffered writer: every backend, one part at a time per file."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, *, block_size: int) -> None:
        super().__init__(fs, path)
        self._file = fs.open(path, "wb", block_size=block_size)

    def write(self, buffers: Iterable[bytes | memoryview]) -> None:
        for buf in buffers:
            self.size += self._file.write(buf)

    def commit(self) -> None:
        self._file.close()

    def abort(self) -> None:
        # Closing would publish a partial object; discard the buffer instead.
        discard = getattr(self._file, "discard", None)
        if callable(discard):
            discard()
        else:  # pragma: no cover - every fsspec AbstractBufferedFile has discard()
            self._file.close()
            self.fs.rm_file(self.path)
