"""Local disk: temporary name + fsync + rename, folder fsyncs, ``flock``, positional reads.

The final name of a file holds all its bytes or does not exist: bytes go to a temporary name
in the same folder (:func:`~dcp_fsspec.storage.format.names.temporary_path`), are fsynced, and the name is renamed over
the final one; the folder is fsynced so the rename survives a power loss. Pointer updates are
serialized by ``flock`` on the folder itself, which holds across processes on this machine,
adds no file, and is released when a process dies, even by SIGKILL.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dcp_fsspec.errors import StorageError
from dcp_fsspec.storage.backends.base import InPlaceFiles, RangeReader, Versioned
from dcp_fsspec.storage.backends.generic import FsspecBackend
from dcp_fsspec.storage.backends.uploads import ByteBudget, FileUpload, publish_whole
from dcp_fsspec.storage.format import names
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.file_syncs import FileSyncs

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: pointer updates are locked within a process only
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)
_CAN_ADVISE = hasattr(os, "posix_fadvise")  # not on macOS or Windows
_PROCESS_LOCK = threading.Lock()


class LocalBackend(FsspecBackend):
    real_folders = True
    answers_locally = True
    exclusive_across_processes = True

    @classmethod
    def accepts(cls, fs: fsspec.AbstractFileSystem) -> bool:
        return isinstance(fs, LocalFileSystem)

    def plain_url(self, path: str) -> str:
        return path

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
        return LocalUpload(self.fs, path, fsync=fsync, syncs=syncs)

    def write_small_atomic(
        self,
        path: str,
        data: bytes,
        *,
        fsync: bool = True,
        sync_folder: bool = True,
        syncs: FileSyncs | None = None,
    ) -> None:
        if syncs is not None and sync_folder:
            raise ValueError(
                f"writing {path} with syncs: its folder is fsynced by the caller, after them (sync_folder=False)"
            )
        folder = os.path.dirname(path)
        with storage_errors("write", path):
            os.makedirs(folder, exist_ok=True)
            publish_whole(LocalUpload(self.fs, path, fsync=fsync, syncs=syncs), [data])
            if fsync and sync_folder:
                fsync_dir(folder)

    def sync_folder(self, path: str) -> None:
        fsync_dir(path)

    def file_syncs(self, threads: int) -> FileSyncs:
        return FileSyncs(threads)

    # fsspec's local find and cat_file stat every entry again through info() and build a file
    # object per read: a large share of a small save's and load's time.

    def find(self, path: str, *, withdirs: bool = False) -> dict[str, dict[str, Any]]:
        url = self.url_of(path)
        with storage_errors("list", url):
            return self.retry.call(partial(_find, path, withdirs=withdirs), url=url)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

    def read_versioned(self, path: str) -> Versioned:
        url = self.url_of(path)
        with storage_errors("read", url):
            try:
                return Versioned(self.retry.call(Path(path).read_bytes, url=url))
            except FileNotFoundError:
                return Versioned(None)

    @contextmanager
    def exclusive(self, folder: str) -> Iterator[None]:
        if fcntl is None:  # pragma: no cover - Windows
            with _PROCESS_LOCK:
                yield
            return
        with storage_errors("lock", folder):
            os.makedirs(folder, exist_ok=True)
            fd = os.open(folder, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:  # e.g. some network filesystems
                logger.debug(
                    "cannot lock %s (%s); the pointer update is locked within this process only", folder, e
                )
                with _PROCESS_LOCK:
                    yield
                return
            yield
        finally:
            os.close(fd)

    def replace_if_unchanged(self, path: str, data: bytes, expected: Any) -> bool:
        # Under exclusive(): nobody else writes this name, so a plain atomic write is the swap;
        # temporary names of it that a writer killed before its rename left are removed here.
        self.write_small_atomic(path, data)
        folder, name = os.path.split(path)
        for other in os.listdir(folder):
            if names.is_temporary(other) and other.startswith(f".{name}."):
                try:
                    os.unlink(os.path.join(folder, other))
                except FileNotFoundError:
                    pass
        return True

    def remove_link(self, path: str, within: str) -> str | None:
        link = _first_link(path, within)
        if link is None:
            return None
        target = os.path.realpath(link)
        with storage_errors("delete", self.url_of(link)):
            try:
                os.unlink(link)
            except FileNotFoundError:
                return target  # another process removed it first
        logger.warning(
            "removed the symbolic link %s (to %s) rather than anything it leads to: dcp_fsspec never "
            "deletes or writes through a link under %s; the link's target is left as it was",
            self.url_of(link),
            target,
            self.url_of(within),
        )
        return target

    def remove_files(self, paths: Sequence[str], *, within: str) -> None:
        folder = within.rstrip(os.sep) + os.sep
        outside = [path for path in paths if not path.startswith(folder)]
        if outside:
            raise ValueError(f"refusing to remove {outside[0]}: it is not under {self.url_of(within)}")
        for path in paths:
            if self.remove_link(path, within) is None:
                with storage_errors("delete", self.url_of(path)):
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass  # already gone

    def remove_trees(self, paths: Sequence[str], *, within: str) -> None:
        # Not the default (find, then remove_files): it would leave the folders behind.
        for path in paths:
            if self.remove_link(path, within) is None:
                with storage_errors("delete", self.url_of(path)):
                    _remove_tree(path)

    def link_out_of(self, path: str, folder: str) -> str | None:
        real, root = os.path.realpath(path), os.path.realpath(folder)
        return None if real == root or real.startswith(root.rstrip(os.sep) + os.sep) else real

    def range_reader(self) -> RangeReader:
        return LocalFiles()

    def in_place_files(self) -> InPlaceFiles:
        return LocalFiles()


class LocalUpload(FileUpload):
    """Temporary file + fsync + rename: the final name holds all the bytes or does not exist.

    With ``syncs``, the rename comes first and the fsync on one of ``syncs``' threads (the
    owner of ``syncs`` waits for it before anything names the file, see :mod:`~dcp_fsspec.storage.transport.file_syncs`).
    """

    def __init__(
        self, fs: fsspec.AbstractFileSystem, path: str, *, fsync: bool = True, syncs: FileSyncs | None = None
    ) -> None:
        super().__init__(fs, path)
        self._fsync = fsync
        self._syncs = syncs if fsync else None
        self._tmp = names.temporary_path(path)
        self._file = open(self._tmp, "wb", buffering=0)
        # Buffers not yet written, by reference: small records go out many per writev() call
        # rather than three write() calls each (10,000 small tensors: 30,000 → ~100 syscalls).
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._advise = _CAN_ADVISE
        self._handed = 0  # where the range handed to the disk last time starts
        self._handed_end = 0  # and where it ends

    _FLUSH_BYTES = 1 << 20
    _FLUSH_BUFFERS = 512  # well under IOV_MAX (1024 on Linux)

    def write(self, buffers: Iterable[bytes | memoryview]) -> None:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            if view.nbytes:
                self._pending.append(view)
                self._pending_bytes += view.nbytes
                self.size += view.nbytes
        if self._pending_bytes >= self._FLUSH_BYTES or len(self._pending) >= self._FLUSH_BUFFERS:
            self._flush()

    def _flush(self) -> None:
        views, self._pending, self._pending_bytes = self._pending, [], 0
        fd = self._file.fileno()
        while views:
            written = os.writev(fd, views)
            while views and written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            if written:
                views[0] = views[0][written:]

    def start_writeback(self) -> None:
        """Write what is buffered and let the disk start writing it back, without waiting.

        Left to the kernel, writeback starts only past its dirty threshold, and the closing
        fsync waits for the rest. ``POSIX_FADV_DONTNEED`` on Linux starts the writeback of the
        range's dirty pages and drops its clean ones: the range before, written back by now.
        """
        self._flush()
        if not self._advise:
            return
        start, self._handed = self._handed, self._handed_end
        self._handed_end = self.size
        try:
            os.posix_fadvise(self._file.fileno(), start, self.size - start, os.POSIX_FADV_DONTNEED)
        except OSError as e:  # advice only: the closing fsync writes whatever is left
            logger.debug("not handing %s to the disk early: %s", self._tmp, e)
            self._advise = False

    def commit(self) -> None:
        self._flush()
        if self._syncs is not None:
            os.replace(self._tmp, self.path)
            self._syncs.submit(self._file, self.path)  # it closes the file once fsynced
            return
        if self._fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


class LocalFiles(InPlaceFiles):
    """Local files opened once each, for positional reads from several threads at once."""

    def __init__(self) -> None:  # no backend: every read is an os call here
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def read(self, path: str, size: int, offset: int) -> bytes:
        return os.pread(self._fd(path), size, offset)

    def size(self, path: str) -> int:
        """The file's length now (of the file opened, whatever its name points to later)."""
        return os.fstat(self._fd(path)).st_size

    def read_into(self, path: str, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``path`` at ``offset``: the bytes read, fewer only at the end of the file."""
        fd = self._fd(path)
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if not n:
                break
            got += n
        return got

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _find(path: str, *, withdirs: bool) -> dict[str, dict[str, Any]]:
    """fsspec's local ``find(path, withdirs=…, detail=True)`` from one ``scandir`` per folder.

    As fsspec's: ``path`` itself may be a link to a folder (a ``save_dirname`` on another disk);
    below it, symbolic links are listed (type ``"other"``, their target's size, 0 if it has
    none) and never followed, so a link cannot lead the walk out of ``path`` or round in a
    loop. Unlike fsspec's, a folder that cannot be read raises rather than being skipped. What
    disappears during the walk (retention's thread deleting an iteration, a temporary file
    renamed) is left out, and nothing else with it.
    """
    try:
        top = os.stat(path)
    except FileNotFoundError:
        return {}
    if not stat.S_ISDIR(top.st_mode):
        return {path: _info(path, top)}
    found = {path: _info(path, top)} if withdirs else {}
    folders = [path]
    while folders:
        folder = folders.pop()
        prefix = folder.rstrip("/") + "/"
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue  # deleted (or replaced) since its parent was read
        for entry in entries:
            child = prefix + entry.name
            try:
                if entry.is_symlink():
                    found[child] = {"name": child, "size": _target_size(child), "type": "other"}
                elif entry.is_dir(follow_symlinks=False):
                    folders.append(child)
                    if withdirs:
                        found[child] = _info(child, entry.stat(follow_symlinks=False))
                else:
                    found[child] = _info(child, entry.stat(follow_symlinks=False))
            except FileNotFoundError:
                continue  # deleted since the folder was read
    return dict(sorted(found.items()))


def _first_link(path: str, within: str) -> str | None:
    """The first symbolic link on ``path`` below ``within`` (``path`` itself included), or None.
    ``within`` itself may be a link (a ``save_dirname`` on another disk)."""
    relative = os.path.relpath(path, within)
    if relative == os.curdir or relative.startswith(os.pardir):
        return None
    current = within
    for part in relative.split(os.sep):
        current = os.path.join(current, part)
        if os.path.islink(current):
            return current
    return None


def _remove_tree(path: str) -> None:
    """Delete ``path`` and everything under it; a link under it is removed, never followed
    (``shutil.rmtree`` unlinks links inside, and refuses a link on top: checked first)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass  # already gone (or going: another deleter; what is left is retried at the next save)


def _info(path: str, st: os.stat_result) -> dict[str, Any]:
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
    return {"name": path, "size": st.st_size, "type": kind}


def _target_size(link: str) -> int:
    try:
        return os.stat(link).st_size
    except OSError:  # dangling, or a loop of links
        return 0


def fsync_dir(path: str) -> None:
    """fsync a local folder so the renames in it survive a crash."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise StorageError(f"cannot open folder {path!r} to fsync it: {e}") from e
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
