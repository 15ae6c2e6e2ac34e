"""``memory://``: fsspec's in-process store. Another process cannot see it, so asynchronous saves
run in a thread instead of a background process; a data file enters the store only when its
upload commits (fsspec's own ``open("wb")`` puts it there at once, half written)."""

from __future__ import annotations

from collections.abc import Iterable

import fsspec
from fsspec.implementations.memory import MemoryFile

from ..file_syncs import FileSyncs
from ..uploads import ByteBudget, FileUpload
from .base import Backend


class MemoryBackend(Backend):
    name = "memory://"
    shared_across_processes = False
    answers_locally = True
    exclusive_across_processes = True

    def new_upload(
        self, path: str, *, part_size: int, budget: ByteBudget, fsync: bool = True, multipart_threshold: int = 0,
        syncs: FileSyncs | None = None,
    ) -> FileUpload:
        return MemoryUpload(self.fs, path)


class MemoryUpload(FileUpload):
    """The file's bytes, in a ``MemoryFile`` the store holds only from :meth:`commit` on: until
    then no reader sees the name, and :meth:`abort` leaves nothing behind."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        super().__init__(fs, path)
        stripped = self.fs._strip_protocol(path)
        if stripped in getattr(self.fs, "pseudo_dirs", ()):
            raise IsADirectoryError(path)
        self._file: MemoryFile | None = MemoryFile(self.fs, stripped)

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
