"""``memory://``: fsspec's in-process store, as a backend that implements the core and nothing else.

It reads, lists and removes through fsspec's own calls, retried as every backend's are. A file
enters the store only when its upload commits (fsspec's ``open("wb")`` puts it there at once,
half written). No other process sees the
store: asynchronous saves run in a thread, and the default lock, within this process, holds off
every writer there is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import fsspec
from fsspec.implementations.memory import MemoryFile

from dcp_fsspec.errors import StorageError
from dcp_fsspec.storage.backends.base import Backend, Versioned
from dcp_fsspec.storage.backends.uploads import ByteBudget, FileUpload
from dcp_fsspec.storage.transport.file_syncs import FileSyncs

_SWAPS = threading.Lock()


class MemoryBackend(Backend):
    shared_across_processes = False
    answers_locally = True
    exclusive_across_processes = True  # every writer is in this process

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return bytes(self.call("cat_file", path, start=start, end=end))

    def read_versioned(self, path: str) -> Versioned:
        try:
            return Versioned(bytes(self.call("cat_file", path)))
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
        try:
            return MemoryUpload(self.fs, self.fs._strip_protocol(path))
        except OSError as e:
            raise StorageError(f"cannot create {self.url_of(path)}: {e}") from e

    def find(self, path: str, *, withdirs: bool = False) -> dict[str, dict[str, Any]]:
        try:
            return dict(self.call("find", path, withdirs=withdirs, detail=True))
        except FileNotFoundError:
            return {}

    def remove_files(self, paths: Sequence[str], *, within: str) -> None:
        folder = self.fs._strip_protocol(within).rstrip("/") + "/"
        outside = [p for p in paths if not self.fs._strip_protocol(p).startswith(folder)]
        if outside:
            raise ValueError(f"refusing to remove {outside[0]}: it is not under {self.url_of(within)}")
        for path in sorted(paths, key=len, reverse=True):  # a folder's files before the folder
            try:
                self.call("rm", path)
            except FileNotFoundError:
                pass  # already gone

    def replace_if_unchanged(self, path: str, data: bytes, expected: Versioned) -> bool:
        with _SWAPS:  # a compare-and-swap of its own: it holds without the caller's lock too
            if self.read_versioned(path).data != expected.data:
                return False
            MemoryFile(self.fs, self.fs._strip_protocol(path), data).commit()
            return True


class MemoryUpload(FileUpload):
    """The file's bytes, in a ``MemoryFile`` the store holds only from :meth:`commit` on: until
    then no reader sees the name, and :meth:`abort` leaves nothing behind."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        super().__init__(fs, path)
        if path in fs.pseudo_dirs:
            raise IsADirectoryError(path)
        parent = fs._parent(path)
        while parent and parent != fs.root_marker:
            if parent in fs.store:  # a file where a folder of the path should be
                raise NotADirectoryError(f"{parent} is a file")
            parent = fs._parent(parent)
        self._file: MemoryFile | None = MemoryFile(fs, path)

    def write(self, buffers: Iterable[bytes | memoryview]) -> None:
        assert self._file is not None, "write after commit or abort"
        for buf in buffers:
            self.size += self._file.write(buf)

    def commit(self) -> None:
        assert self._file is not None, "commit after abort"
        self._file.commit()
        self._file = None

    def abort(self) -> None:
        self._file = None
