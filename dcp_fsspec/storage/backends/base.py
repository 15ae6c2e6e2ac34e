"""The generic backend: what any fsspec filesystem can do, and the interface the others refine.

A :class:`Backend` wraps one filesystem and the retry policy its calls run under. Its flags say
what the store can do; its methods are the operations that differ between stores. Every call
that reaches the store goes through :meth:`Backend.call` (retried, and a failure other than
absence becomes a ``StorageError`` naming the URL).
"""

from __future__ import annotations

import asyncio
import posixpath
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import fsspec

from ...errors import DcpFsspecError, StorageError
from ..file_syncs import FileSyncs
from ..retry import RetryPolicy
from ..uploads import MIN_PART_SIZE, ByteBudget, FileUpload

# Pointer updates on stores without conditional writes or locks, serialized within this process.
_PROCESS_LOCK = threading.Lock()
_VERBS = {"info": "check", "cat_file": "read", "find": "list", "ls": "list", "rm": "delete",
          "rm_file": "delete", "pipe_file": "write", "exists": "check", "makedirs": "create"}  # fmt: skip


@dataclass(frozen=True)
class Versioned:
    """A small file's bytes (``None``: absent) and the version they were read at, where the
    store has versions (S3's ETag): what :meth:`Backend.replace_if_unchanged` compares."""

    data: bytes | None
    version: str | None = None


class RangeReader:
    """Synchronous ranged reads of one load, closed when the load ends (generic: ``cat_file``)."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def read(self, path: str, size: int, offset: int) -> bytes:
        return bytes(self.fs.cat_file(path, start=offset, end=offset + size))

    def close(self) -> None:
        pass


class InPlaceFiles(RangeReader):
    """Ranged reads that fill a caller's memory (a load's target tensor) without a copy of their own."""

    def size(self, path: str) -> int:
        """The file's length now."""
        raise NotImplementedError

    def read_into(self, path: str, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``path`` at ``offset``: the bytes read, fewer only at the end of the file."""
        raise NotImplementedError


class LoopFiles(InPlaceFiles):
    """:class:`InPlaceFiles` of a store read on its filesystem's event loop (S3, GCS, Azure).

    Each call blocks its (pool) thread while the read runs on the loop, retried by the backend's
    policy; a retried read fills the same memory again from its first byte.
    """

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend.fs)
        self.backend = backend
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


class Backend:
    """Any fsspec filesystem, with only what fsspec's API promises.

    Flags (class attributes, so a subclass states its store's nature in one place):

    * ``real_folders``: a file's folder must exist before it is written, and a rename within a
      folder is atomic (local disk, SFTP); object stores have neither.
    * ``shared_across_processes``: another process sees what this one writes (not ``memory://``).
    * ``is_local``: plain local files (``os`` calls, ``fsync``, in-place reads).
    * ``answers_locally``: a request is answered on this machine (local disk, ``memory://``), in
      microseconds: there is no round trip to hide, so small independent reads go one after
      another on the calling thread (a hand-off to another thread costs more than the read).
    * ``conditional_writes``: the store settles concurrent pointer updates itself (S3's
      ``If-Match``); elsewhere :meth:`exclusive` serializes them.
    * ``exclusive_across_processes``: of writers in several processes, :meth:`exclusive` (or the
      store's conditional writes) lets exactly one create a small file that is absent (local disk:
      ``flock``; S3: ``If-None-Match``; ``memory://``: one process). Elsewhere (GCS, Azure, SFTP
      today) two processes may both believe they created it.
    """

    name: ClassVar[str] = "generic fsspec"
    real_folders: ClassVar[bool] = False
    shared_across_processes: ClassVar[bool] = True
    is_local: ClassVar[bool] = False
    answers_locally: ClassVar[bool] = False
    conditional_writes: ClassVar[bool] = False
    exclusive_across_processes: ClassVar[bool] = False

    def __init__(
        self, fs: fsspec.AbstractFileSystem, retry: RetryPolicy, url_of: Callable[[str], str] | None = None
    ) -> None:
        self.fs = fs
        self.retry = retry
        self._url_of = url_of

    @classmethod
    def accepts(cls, fs: fsspec.AbstractFileSystem) -> bool:
        """Whether this backend's quirks apply to ``fs`` (the table matched its protocol)."""
        return True

    # --- calls ------------------------------------------------------------------------------

    def url_of(self, path: str) -> str:
        """The URL of ``path``, for messages: in the form the user wrote, where the backend
        belongs to a :class:`~..urls.Location` (which passes its ``url_of``)."""
        return self._url_of(path) if self._url_of is not None else self.plain_url(path)

    def plain_url(self, path: str) -> str:
        """The URL fsspec gives ``path`` on this store."""
        return str(self.fs.unstrip_protocol(path))

    def call(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<method>(path, …)``, retried; a failure other than absence is a StorageError.

        ``FileNotFoundError`` passes through unchanged (what absence means is the caller's
        call), unless the store says its container itself is missing: that is a wrong URL.
        """
        url = self.url_of(path)
        try:
            return self.retry.run(self.fs, method, path, *args, url=url, **kwargs)
        except FileNotFoundError as e:
            self.raise_if_no_container(e, url)
            raise
        except DcpFsspecError:
            raise
        except OSError as e:
            raise StorageError(f"cannot {_VERBS.get(method, method)} {url}: {e}") from e

    def container_missing(self, error: FileNotFoundError) -> bool:
        """Whether ``error`` means the bucket (not the file) does not exist."""
        return False

    def raise_if_no_container(self, error: FileNotFoundError, url: str) -> None:
        """Raise a StorageError if ``error`` means the bucket (not the file) does not exist."""
        if self.container_missing(error):
            raise StorageError(
                f"cannot use {url}: its bucket does not exist ({error}); create the bucket or fix the URL"
            ) from error

    def invalidate(self, path: str) -> None:
        """Forget cached listings of ``path`` (s3fs caches them; other ranks may have written)."""
        self.fs.invalidate_cache(path)

    def find(self, path: str, *, withdirs: bool = False) -> dict[str, dict[str, Any]]:
        """Every file under ``path`` → its info (``size``, ``type``), in one recursive listing
        (one request per 1,000 files on S3), read fresh; with ``withdirs`` every folder too,
        ``path`` included. ``{}`` where ``path`` does not exist.

        Generic: fsspec's ``find``, which skips folders it fails to read: a caller that acts on
        an absence confirms it with a call that raises on failure.
        """
        self.invalidate(path)
        try:
            return dict(self.call("find", path, withdirs=withdirs, detail=True))
        except FileNotFoundError:
            return {}

    def folder_exists(self, path: str) -> bool:
        """Whether the folder ``path`` exists (on object stores: whether anything is stored under
        it). A backend failure raises StorageError: it is not an answer."""
        self.invalidate(posixpath.dirname(path))
        try:
            self.call("info", path)
        except FileNotFoundError:
            return False
        return True

    # --- writing ----------------------------------------------------------------------------

    def make_folder(self, path: str) -> None:
        """Create ``path`` where folders are real; never on object stores (where it may create a
        bucket; S3 checks its bucket exists instead)."""
        if self.real_folders:
            self.call("makedirs", path, exist_ok=True)

    def new_upload(
        self, path: str, *, part_size: int, budget: ByteBudget, fsync: bool = True, multipart_threshold: int = 0,
        syncs: FileSyncs | None = None,
    ) -> FileUpload:
        """A :class:`FileUpload` that publishes ``path`` whole on commit (generic: fsspec's buffered
        file, which object stores publish on close; it relies on the driver's retries).

        ``part_size`` and ``multipart_threshold`` (a file up to this size goes in one request)
        tune object stores; ``budget`` bounds the upload data in memory; ``fsync``: local disk,
        where ``syncs`` (from :meth:`file_syncs`) takes the fsync off the commit: see there."""
        return BufferedUpload(self.fs, path, block_size=max(part_size, MIN_PART_SIZE))

    def write_small_atomic(
        self, path: str, data: bytes, *, fsync: bool = True, sync_folder: bool = True, syncs: FileSyncs | None = None
    ) -> None:
        """Write a small file so readers see the old content or the new, never a mix (generic: one
        ``pipe_file``, which object stores and ``memory://`` apply whole).

        ``fsync`` (local disk): the file, and its folder unless ``sync_folder`` is false (the
        caller then fsyncs the folder itself, see :meth:`sync_folder`); ``syncs`` as in
        :meth:`new_upload`."""
        self.call("pipe_file", path, data)
        self.invalidate(self.fs._parent(path))

    def sync_folder(self, path: str) -> None:
        """Make the renames in ``path`` durable where that is a separate step (local disk)."""

    def file_syncs(self, threads: int) -> FileSyncs | None:
        """Where files are fsynced (local disk): a :class:`~..file_syncs.FileSyncs` for one
        save, whose uploads then rename each file into place at once and fsync it on one of
        ``threads`` threads; the caller waits for it before anything names the files. ``None``
        elsewhere (a file is in the store once its upload commits)."""
        return None

    def abort_pending_uploads(self, folder: str) -> None:
        """Abort uploads a killed save left under ``folder`` where the store keeps them (S3)."""

    # --- deleting ---------------------------------------------------------------------------

    def remove_link(self, path: str, within: str) -> str | None:
        """Remove the symbolic link that stands on ``path`` below ``within``, if one does: the
        link itself, never its target. Returns where it led; ``None`` where there is no link
        (generic: stores without links).

        Every delete, rename or write under a folder the caller owns (``within``) calls it
        first: a link there may lead into another run's checkpoint.
        """
        return None

    def remove_files(self, paths: Sequence[str], *, within: str) -> None:
        """Delete the files ``paths`` (all under ``within``) in as few requests as the store
        allows; those already absent are fine. A link on the way is removed, not followed
        (:meth:`remove_link`).

        Generic: one ``rm`` of the whole list (drivers that have a bulk delete use it), then
        one by one if some were absent.

        Raises:
            StorageError: the backend failed; some of ``paths`` may be deleted.
        """
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
                raise StorageError(f"cannot delete {len(paths)} file(s) under {self.url_of(within)}: {e}") from e
        self.invalidate(within)

    def remove_trees(self, paths: Sequence[str], *, within: str) -> None:
        """Delete each of ``paths`` (all under ``within``) with everything under it, and the
        unfinished uploads under it where the store keeps them; those already absent are fine.
        A link on the way, or anywhere under a path, is removed itself, never followed.

        Generic: one recursive ``rm`` a path.

        Raises:
            StorageError: the backend failed; some of ``paths`` may be half deleted.
        """
        for path in paths:
            if self.remove_link(path, within) is None:
                self._rm_if_present(path, recursive=True)
        self.invalidate(within)

    def _rm_if_present(self, path: str, *, recursive: bool = False) -> None:
        try:
            self.call("rm", path, recursive=recursive)
        except FileNotFoundError:
            pass  # already gone

    # --- the pointer's compare-and-swap -----------------------------------------------------

    @contextmanager
    def exclusive(self, folder: str) -> Iterator[None]:
        """Hold off other writers of small files in ``folder`` (generic: within this process)."""
        with _PROCESS_LOCK:
            yield

    def read_versioned(self, path: str) -> Versioned:
        """``path``'s bytes and their version, in one read (``Versioned(None)`` if absent)."""
        self.invalidate(self.fs._parent(path))
        try:
            return Versioned(self.call("cat_file", path))
        except FileNotFoundError:
            return Versioned(None)

    def replace_if_unchanged(self, path: str, data: bytes, expected: Versioned) -> bool:
        """Write ``data`` to ``path`` if it still holds ``expected``; False if another write came
        first. Without conditional writes this must run inside :meth:`exclusive`, which makes the
        read and the write one step."""
        self.write_small_atomic(path, data)
        return True

    # --- reading ----------------------------------------------------------------------------

    def link_out_of(self, path: str, folder: str) -> str | None:
        """Where ``path`` really is, if the store resolves it (through a symbolic link) to a place
        outside ``folder``; ``None`` while it stays inside (generic: stores without links)."""
        return None

    @property
    def async_reads(self) -> bool:
        """Whether ranges are fetched on the filesystem's event loop (s3fs, gcsfs, adlfs)."""
        return bool(getattr(self.fs, "async_impl", False)) and getattr(self.fs, "loop", None) is not None

    async def read_range_async(self, path: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of ``path``, on the event loop (only where :attr:`async_reads`)."""
        return await self.fs._cat_file(path, start=start, end=end)

    async def read_range_into_async(self, path: str, start: int, view: memoryview) -> int:
        """Fill ``view`` with the bytes of ``path`` from ``start``, on the event loop: the bytes
        read, fewer only where the file ends (generic: read, then copy; S3 reads into it)."""
        data = await self.read_range_async(path, start, start + len(view))
        view[: len(data)] = data
        return len(data)

    def in_place_files(self) -> InPlaceFiles | None:
        """Reads a load fills its targets with directly, closed by the caller (generic: on the
        event loop where :attr:`async_reads`, else none: the load streams every record)."""
        return LoopFiles(self) if self.async_reads else None

    def range_reader(self) -> RangeReader:
        """A reader for the synchronous ranged reads of one load; the caller closes it."""
        return RangeReader(self.fs)


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
