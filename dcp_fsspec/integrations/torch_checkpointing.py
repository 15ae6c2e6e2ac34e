"""torch_checkpointing's storage on any fsspec URL, through dcp_fsspec's backends.

:class:`FsspecStorageConfig` goes in ``CheckpointManager.Config(storage_config=...)``. Every
path the manager passes is taken relative to the config's ``url``. Writes are our uploads
(multipart on S3), reads are ranged reads into the caller's memory, and every call retries
and fails with our error types. A folder rename (the manager's commit) moves no bytes through
this process: it is a rename where folders are real, a server-side copy on object stores.
:func:`commit_by_marker` changes a manager's config to commit each step with a marker file
instead, so nothing is copied at all. The storage then hides and refuses steps without it.
"""

from __future__ import annotations

import dataclasses
import io
import posixpath
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, cast

from dcp_fsspec.integrations._files import child, locate, require, write_file

require(
    "torch_checkpointing.storage.base_storage",
    "torch-checkpointing",
    "dcp_fsspec.integrations.torch_checkpointing",
)

from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_writer import CallbackArgs
from torch_checkpointing.metadata_serialization import METADATA_FILE_NAME
from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from dcp_fsspec.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UsageError,
)
from dcp_fsspec.storage.backends.base import InPlaceFiles, RangeReader
from dcp_fsspec.storage.backends.uploads import ByteBudget, FileUpload
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.urls import Location

__all__ = ["COMMIT_MARKER", "FsspecStorage", "FsspecStorageConfig", "commit_by_marker"]

MiB = 1024 * 1024
# The file that commits a step written in place (see commit_by_marker).
COMMIT_MARKER = ".committed"


@dataclass
class FsspecStorageConfig(StorageConfig):
    """Where torch_checkpointing's checkpoints live, and how to reach them.

    Attributes:
        url: the root every checkpoint path is relative to (``s3://bucket/run``, a local path).
        storage_options: fsspec options for ``url`` (credentials, endpoint); kept out of ``repr``.
        part_size: bytes per upload part (S3 multipart) and per ranged read.
        read_workers: concurrent ranged reads when the manager fills a whole file.
        copy_workers: concurrent server-side copies in a folder rename on an object store.
        commit_marker: a step is committed by its ``COMMIT_MARKER`` file, not by being there.
            Listings skip step folders without it, and reading a file of one raises
            :class:`CheckpointNotFoundError`. Set by :func:`commit_by_marker`.
    """

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    part_size: int = 16 * MiB
    read_workers: int = 8
    copy_workers: int = 8
    commit_marker: bool = False

    def create_storage(self) -> FsspecStorage:
        return FsspecStorage(self)


class FsspecStorage(Storage):
    """torch_checkpointing's ``Storage`` over one fsspec URL (see the module docstring)."""

    def __init__(self, config: FsspecStorageConfig) -> None:
        self._config = config
        self._root = locate(config.url, config.storage_options)
        # Step folders seen holding the marker: a commit is not undone except by deleting the step.
        self._committed: set[str] = set()

    @property
    def mmap_fill_workers(self) -> int | None:
        return self._config.read_workers

    @property
    def mmap_fill_chunk_bytes(self) -> int | None:
        return self._config.part_size

    # --- paths ------------------------------------------------------------------------------

    def where(self, path: Path | str) -> Location:
        """The location of ``path``: relative to the root URL, or the root URL itself below it.

        Raises:
            UsageError: ``path`` is outside the root URL or climbs out with ``..``.
        """
        given = PurePosixPath(path)
        root = PurePosixPath(self._config.url)
        if given == root or root in given.parents:
            given = given.relative_to(root)
        if given.is_absolute() or ".." in given.parts:
            raise UsageError(
                f"path {str(path)!r} is outside the storage's URL {self._root.url}: "
                "give checkpoint paths relative to FsspecStorageConfig.url"
            )
        parts = [p for p in given.parts if p != "."]
        return child(self._root, *parts) if parts else self._root

    def remap_path(self, path: Path) -> str:
        return self.where(path).url

    # --- reading ----------------------------------------------------------------------------

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        """A seekable stream of the file; read whole first unless ``read_args`` says not to."""
        where = self.where(path)
        self._require_committed(where)
        known = read_args.known_size_bytes if read_args is not None else None
        stream = RangedFile(where, self._size(where) if known is None else known)
        if read_args is not None and not read_args.pre_read_full_file:
            return stream
        with stream:
            whole = bytearray(stream.size)
            self._fill(stream, memoryview(whole))
        # Their own local storage returns a BytesIO here as well: callers only read, readinto and seek.
        return cast(io.RawIOBase, io.BytesIO(whole))

    def _fill(self, stream: RangedFile, view: memoryview) -> None:
        """Fill ``view`` from the file's start with concurrent ranged reads."""
        step = self._config.part_size

        def fill(at: int) -> None:
            want = min(step, len(view) - at)
            if stream.read_at(at, view[at : at + want]) < want:
                raise CorruptCheckpointError(
                    f"{stream.where.url} is shorter than its listed size: it changed while read"
                )

        with ThreadPoolExecutor(self._config.read_workers, thread_name_prefix="tc-read") as pool:
            list(pool.map(fill, range(0, len(view), step)))

    def getsize(self, path: Path) -> int:
        where = self.where(path)
        self._require_committed(where)
        return self._size(where)

    def _size(self, where: Location) -> int:
        try:
            return int(where.backend.call("info", where.path)["size"])
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"no file at {where.url}: check the checkpoint path") from e

    # --- writing ----------------------------------------------------------------------------

    def stream_write(self, path: Path) -> io.IOBase:
        """A stream that publishes the file whole when closed, and not at all if its block fails."""
        where = self.where(path)
        backend = where.backend
        backend.make_folder(posixpath.dirname(where.path))
        part = self._config.part_size
        with storage_errors("write", where.url):
            upload = backend.new_upload(where.path, part_size=part, budget=ByteBudget(4 * part))
        return UploadStream(where, upload)

    def write(self, path: Path, data: Any) -> None:
        write_file(self.where(path), memoryview(data).cast("B"), part_size=self._config.part_size)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        where = self.where(path)
        where.backend.make_folder(where.path)

    # --- deleting ---------------------------------------------------------------------------

    def delete(self, path: Path) -> None:
        where = self.where(path)
        try:
            where.backend.call("rm_file", where.path)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"no file to delete at {where.url}: check the path") from e
        where.backend.invalidate(posixpath.dirname(where.path))

    def rmdir(self, path: Path) -> None:
        where = self.where(path)
        below = where.path.rstrip("/") + "/"
        self._committed = {c for c in self._committed if c != where.path and not c.startswith(below)}
        where.backend.remove_trees([where.path], within=posixpath.dirname(where.path))

    # --- the commit -------------------------------------------------------------------------

    def rename(
        self, src_path: Path, dst_path: Path, is_directory: bool = False, background_cleanup: bool = False
    ) -> None:
        """Move a file or folder so its contents land at ``dst_path``, per ``Storage.rename``.

        Where folders are real this is the store's rename. On object stores each object is
        copied server-side, the checkpoint's metadata file last, then the source is deleted.
        ``background_cleanup`` is accepted; the source is deleted before this returns.

        Raises:
            CheckpointExistsError: the destination is occupied (a ``FileExistsError``).
            CheckpointNotFoundError: there is nothing at ``src_path``.
        """
        src, dst = self.where(src_path), self.where(dst_path)
        backend = src.backend
        backend.invalidate(posixpath.dirname(src.path))
        if not exists(src):
            raise CheckpointNotFoundError(f"nothing to rename at {src.url}: check the path")
        if is_folder(src):
            self._refuse_occupied(dst, allow_empty_folder=True)
            files = backend.find(src.path)
            if backend.real_folders:
                backend.call("mv", src.path, dst.path)
            else:
                self._copy_all(
                    src, dst, sorted(files, key=lambda f: posixpath.basename(f) == METADATA_FILE_NAME)
                )
                backend.remove_trees([src.path], within=posixpath.dirname(src.path))
        else:
            if is_folder(dst):
                raise CheckpointExistsError(
                    f"cannot rename {src.url} onto the folder {dst.url}: delete it first"
                )
            self._move_file(src, dst)
        backend.invalidate(posixpath.dirname(dst.path))

    def _refuse_occupied(self, dst: Location, *, allow_empty_folder: bool) -> None:
        backend = dst.backend
        if not exists(dst):
            return
        if is_folder(dst) and allow_empty_folder and not backend.find(dst.path):
            backend.remove_trees([dst.path], within=posixpath.dirname(dst.path))
            return
        raise CheckpointExistsError(
            f"cannot rename onto {dst.url}: it is occupied, and a commit never overwrites; delete it first"
        )

    def _copy_all(self, src: Location, dst: Location, files: list[str]) -> None:
        """Copy ``files`` (below ``src``) to the same places below ``dst``, server-side.

        The last file is copied after all the others are in place."""
        backend = src.backend
        base = src.path.rstrip("/") + "/"

        def copy(path: str) -> None:
            backend.call("copy", path, posixpath.join(dst.path, path[len(base) :]))

        *first, last = files or [""]
        with ThreadPoolExecutor(self._config.copy_workers, thread_name_prefix="tc-copy") as pool:
            list(pool.map(copy, first))
        if last:
            copy(last)

    def _move_file(self, src: Location, dst: Location) -> None:
        backend = src.backend
        if backend.real_folders:
            backend.call("mv", src.path, dst.path)
            return
        backend.call("copy", src.path, dst.path)
        backend.call("rm_file", src.path)

    # --- finding ----------------------------------------------------------------------------

    def ls(self, path: Path) -> list[str]:
        """The names (not paths) of the entries in the folder ``path``, read fresh.

        On object stores the root URL with nothing below it is an empty folder: there is no
        folder to make before the first save, nor one left after the last step is deleted.
        With ``commit_marker``, a folder that holds files but no marker is left out.

        Raises:
            CheckpointNotFoundError: there is no folder at ``path``.
        """
        where = self.where(path)
        backend = where.backend
        backend.invalidate(where.path)
        try:
            entries = backend.call("ls", where.path, detail=False)
        except FileNotFoundError as e:
            if where.path == self._root.path and not backend.real_folders:
                return []
            raise CheckpointNotFoundError(f"no folder at {where.url}: check the checkpoint path") from e
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries if str(e).rstrip("/") != where.path}
        if self._config.commit_marker:
            names -= self._uncommitted_below(where)
        return sorted(names)

    def _uncommitted_below(self, where: Location) -> set[str]:
        """The names of the folders in ``where`` that hold files but no commit marker."""
        base = where.path.rstrip("/") + "/"
        holding: set[str] = set()
        for file in where.backend.find(where.path):
            folder, _, name = file[len(base) :].partition("/")
            if name and "/" not in name:
                holding.add(folder)
                if name == COMMIT_MARKER:
                    self._committed.add(base + folder)
        return {name for name in holding if base + name not in self._committed}

    def _require_committed(self, where: Location) -> None:
        """With ``commit_marker``: refuse a file below no folder that holds the marker.

        Raises:
            CheckpointNotFoundError: no folder between the file and the root URL is committed.
        """
        if not self._config.commit_marker:
            return
        root = self._root.path.rstrip("/")
        folders: list[str] = []
        folder = posixpath.dirname(where.path)
        while folder.startswith(root + "/"):
            folders.append(folder)
            folder = posixpath.dirname(folder)
        for folder in folders:
            if folder in self._committed or exists(child(self._root, folder[len(root) + 1 :], COMMIT_MARKER)):
                self._committed.add(folder)
                return
        step = self._root.url_of(folders[0]) if folders else self._root.url
        raise CheckpointNotFoundError(
            f"{where.url} is not in a committed step: {step} has no {COMMIT_MARKER} marker, so its save "
            "did not finish; load a committed step (FsspecStorage.ls lists only those)"
        )

    def exists(self, path: Path) -> bool:
        return exists(self.where(path))

    def is_committed(self, path: Path) -> bool:
        """Whether the step at ``path`` holds its commit marker (see :func:`commit_by_marker`)."""
        return exists(self.where(Path(path) / COMMIT_MARKER))

    def isdir(self, path: Path) -> bool:
        return is_folder(self.where(path))


def exists(where: Location) -> bool:
    """Whether anything is at ``where``, with the cached listings of it and above it dropped."""
    where.backend.invalidate(where.path)
    return bool(where.backend.call("exists", where.path))


def commit_by_marker(config: CheckpointManager.Config) -> CheckpointManager.Config:
    """``config`` changed to commit each step with a marker file instead of a folder rename.

    Every rank writes in place at the step's final path. After the writer's barrier each rank
    writes the empty file ``COMMIT_MARKER`` in the step, once any finalize callback already set
    has run. A step without it is uncommitted. The storage's listings leave it out, and a load
    of it raises :class:`CheckpointNotFoundError`: their ``load`` does not check the marker.

    Raises:
        UsageError: ``config.storage_config`` is not an :class:`FsspecStorageConfig`.
    """
    storage = config.storage_config
    if not isinstance(storage, FsspecStorageConfig):
        raise UsageError(
            f"commit_by_marker needs CheckpointManager.Config.storage_config to be an FsspecStorageConfig, "
            f"not {type(storage).__name__}: set storage_config first"
        )
    config.storage_config = dataclasses.replace(storage, commit_marker=True)
    config.save.writer_config.write_to_temp_dir = False
    config.finalize_callback = WriteMarker(config.finalize_callback)
    return config


@dataclass(frozen=True)
class WriteMarker:
    """The finalize callback of :func:`commit_by_marker`; a class so it pickles into their writer process."""

    then: Callable[[CallbackArgs], None] | None = None

    def __call__(self, args: CallbackArgs) -> None:
        if self.then is not None:
            self.then(args)
        args.storage.write(Path(args.path) / COMMIT_MARKER, b"")


def is_folder(where: Location) -> bool:
    """Whether ``where`` is a folder (on object stores: a prefix with objects below it), read fresh."""
    where.backend.invalidate(where.path)
    try:
        return bool(where.backend.call("info", where.path)["type"] == "directory")
    except FileNotFoundError:
        return False


class RangedFile(io.RawIOBase):
    """A seekable read-only stream of one file, each read a ranged read into the caller's buffer."""

    def __init__(self, where: Location, size: int) -> None:
        super().__init__()
        self.where = where
        self.size = size
        self._pos = 0
        self._files: RangeReader = where.backend.in_place_files() or where.backend.range_reader()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        got = self.read_at(self._pos, view)
        self._pos += got
        return got

    def read_at(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``offset`` (up to the file's end): the bytes read."""
        view = view[: max(0, min(len(view), self.size - offset))]
        if not len(view):
            return 0
        with storage_errors("read", self.where.url):
            try:
                if isinstance(self._files, InPlaceFiles):
                    return self._files.read_into(self.where.path, offset, view)
                data = self._files.read(self.where.path, len(view), offset)
            except FileNotFoundError as e:
                raise CheckpointNotFoundError(
                    f"no file at {self.where.url}: check the checkpoint path"
                ) from e
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._files.close()
        super().close()


class UploadStream(io.RawIOBase):
    """A write stream over one upload: published when closed, aborted if its ``with`` block fails."""

    def __init__(self, where: Location, upload: FileUpload) -> None:
        super().__init__()
        self._where = where
        self._upload = upload

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        # A copy: the caller may reuse its buffer once write returns, before the part is sent.
        chunk = bytes(memoryview(data).cast("B"))
        with storage_errors("write", self._where.url):
            self._upload.write([chunk])
        return len(chunk)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if error is not None and not self.closed:
            with storage_errors("abort the upload of", self._where.url):
                self._upload.abort()
            super().close()
            return
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            with storage_errors("write", self._where.url):
                self._upload.commit()
            self._where.backend.invalidate(posixpath.dirname(self._where.path))
        finally:
            super().close()
