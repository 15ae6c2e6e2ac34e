"""``memory://``: fsspec's in-process store, as a backend that implements the core and nothing else.

It works on the store's own dict (``MemoryFileSystem.store``: path → ``MemoryFile``), so fsspec's
calls on the filesystem see the same files. A file enters the store only when its upload
commits (fsspec's ``open("wb")`` puts it there at once, half written). No other process sees the
store: asynchronous saves run in a thread, and the default lock, within this process, holds off
every writer there is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from contextlib import suppress
from typing import Any

import fsspec
from fsspec.implementations.memory import MemoryFile

from dcp_fsspec.storage.backends.base import Backend, Versioned
from dcp_fsspec.storage.backends.uploads import ByteBudget, FileUpload
from dcp_fsspec.storage.transport.file_syncs import FileSyncs

_SWAPS = threading.Lock()


class MemoryBackend(Backend):
    shared_across_processes = False
    answers_locally = True
    exclusive_across_processes = True  # every writer is in this process

    def read_range(self, path: str, start: int, end: int) -> bytes:
        view = self._file(path).getbuffer()
        try:
            return bytes(view[start:end])
        finally:
            view.release()

    def read_versioned(self, path: str) -> Versioned:
        try:
            return Versioned(self._file(path).getvalue())
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
        return MemoryUpload(self.fs, self.fs._strip_protocol(path))

    def find(self, path: str, *, withdirs: bool = False) -> dict[str, dict[str, Any]]:
        key = self.fs._strip_protocol(path)
        under = key.rstrip("/") + "/"
        sizes = {
            name: file.size
            for name, file in list(self.fs.store.items())
            if name == key or name.startswith(under)
        }
        found = {name: {"name": name, "size": size, "type": "file"} for name, size in sizes.items()}
        if withdirs:
            folders = {d for d in self.fs.pseudo_dirs if d == key or d.startswith(under)}
            for name in sizes.keys() - {key}:
                parts = name[len(under) :].split("/")[:-1]
                folders |= {key, *(under + "/".join(parts[:i]) for i in range(1, len(parts) + 1))}
            found |= {d: {"name": d, "size": 0, "type": "directory"} for d in folders}
        return dict(sorted(found.items()))

    def remove_files(self, paths: Sequence[str], *, within: str) -> None:
        for key in map(self.fs._strip_protocol, paths):
            self.fs.store.pop(key, None)
            with suppress(ValueError):  # a folder made by fsspec's makedirs, if it is one
                self.fs.pseudo_dirs.remove(key)

    def replace_if_unchanged(self, path: str, data: bytes, expected: Versioned) -> bool:
        with _SWAPS:  # a compare-and-swap of its own: it holds without the caller's lock too
            if self.read_versioned(path).data != expected.data:
                return False
            MemoryFile(self.fs, self.fs._strip_protocol(path), data).commit()
            return True

    def _file(self, path: str) -> MemoryFile:
        try:
            file: MemoryFile = self.fs.store[self.fs._strip_protocol(path)]
        except KeyError:
            raise FileNotFoundError(f"no such file: {self.url_of(path)}") from None
        return file


class MemoryUpload(FileUpload):
    """The file's bytes, in a ``MemoryFile`` the store holds only from :meth:`commit` on: until
    then no reader sees the name, and :meth:`abort` leaves nothing behind."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        super().__init__(fs, path)
        if path in fs.pseudo_dirs:
            raise IsADirectoryError(path)
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
