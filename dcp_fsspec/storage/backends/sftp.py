"""SFTP (sshfs): real folders, uploads under a temporary name then an atomic rename, and reads
through open/seek/read.

sshfs renames with OpenSSH's ``posix-rename@openssh.com``, which replaces the target
atomically, so data files and the pointer appear whole or not at all, as on local disk. Its
``cat_file`` ignores ``start``/``end``, so ranges are read through a file opened per read; and
OpenSSH drops the connection on single writes of many MiB, so uploads go in small pieces.
Pointer updates are serialized within a process only (SFTP has no locks).
"""

from __future__ import annotations

from collections.abc import Iterable

import fsspec

from dcp_fsspec.storage.backends.generic import FsspecBackend
from dcp_fsspec.storage.backends.uploads import ByteBudget, FileUpload, publish_whole
from dcp_fsspec.storage.format import names
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.file_syncs import FileSyncs


class SftpBackend(FsspecBackend):
    real_folders = True

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
        return RenameUpload(self.fs, path)

    def write_small_atomic(
        self,
        path: str,
        data: bytes,
        *,
        fsync: bool = True,
        sync_folder: bool = True,
        syncs: FileSyncs | None = None,
    ) -> None:
        # asyncssh raises its own SFTPError types (not OSError) for some refusals, e.g. a file
        # standing where the folder should be.
        with storage_errors("write", self.url_of(path), also=(Exception,)):
            self.make_folder(self.fs._parent(path))
            publish_whole(RenameUpload(self.fs, path), [data])
        self.invalidate(self.fs._parent(path))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Through open/seek/read: sshfs's ``cat_file`` ignores the range."""
        # Not block_size=0: sshfs would then read with one unpipelined request, which the
        # server answers with at most its packet limit.
        with self.fs.open(path, "rb") as f:
            f.seek(start)
            data: bytes = f.read(end - start)
        return data

    @property
    def async_reads(self) -> bool:
        return False  # sshfs is async, but its _cat_file reads whole files


class RenameUpload(FileUpload):
    """A temporary name, then a rename: for remote filesystems with real folders.

    Written in small pieces: OpenSSH drops the connection on single writes of many MiB.
    """

    _PIECE = 256 * 1024

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._tmp = names.temporary_path(path)
        self._file = fs.open(self._tmp, "wb")

    def write(self, buffers: Iterable[bytes | memoryview]) -> None:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            for start in range(0, view.nbytes, self._PIECE):
                self._file.write(bytes(view[start : start + self._PIECE]))
            self.size += view.nbytes

    def commit(self) -> None:
        self._file.close()
        self.fs.mv(self._tmp, self.path)

    def abort(self) -> None:
        try:
            self._file.close()
            self.fs.rm_file(self._tmp)
        except OSError:  # the original error matters more; the temporary name is never read
            pass
