"""The backend contract: a small required core, and optional capabilities with safe defaults.

A :class:`Backend` wraps one fsspec filesystem and the retry policy its calls run under. A
subclass implements the six core methods (read a range, read a small file with its version,
upload a whole file, list, remove files, compare-and-swap a small file). Every other member has
a default built on that core or on plain fsspec calls; a subclass overrides one only where its
store does better. The generic fsspec backend is :class:`~dcp_fsspec.storage.backends.generic.FsspecBackend`.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec

from dcp_fsspec.errors import DcpFsspecError, StorageError
from dcp_fsspec.storage.backends.uploads import MIN_PART_SIZE, ByteBudget, FileUpload, publish_whole
from dcp_fsspec.storage.transport.file_syncs import FileSyncs
from dcp_fsspec.storage.transport.retry import RetryPolicy

# Small-file updates on stores without conditional writes or locks, serialized within this process.
_PROCESS_LOCK = threading.Lock()
_VERBS = {
    "info": "check",
    "cat_file": "read",
    "find": "list",
    "ls": "list",
    "rm": "delete",
    "rm_file": "delete",
    "pipe_file": "write",
    "exists": "check",
    "makedirs": "create",
}


@dataclass(frozen=True)
class Versioned:
    """A small file's bytes (``None``: absent) and the version they were read at, where the
    store has versions (S3's ETag): what :meth:`Backend.replace_if_unchanged` compares."""

    data: bytes | None
    version: str | None = None


class RangeReader:
    """Synchronous ranged reads of one load, closed when the load ends (default: the backend's
    :meth:`~Backend.read_range`)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def read(self, path: str, size: int, offset: int) -> bytes:
        return self.backend.read_range(path, offset, offset + size)

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


class Backend(abc.ABC):
    """One store: the core every backend implements, and capabilities with safe defaults.

    The flags (class attributes) state the store's nature; the defaults are the safe answer:

    * ``real_folders``: a file's folder must exist before it is written, and a rename within a
      folder is atomic (local disk, SFTP); object stores have neither.
    * ``shared_across_processes``: another process sees what this one writes (not ``memory://``).
    * ``answers_locally``: a request is answered on this machine (local disk, ``memory://``):
      there is no round trip to hide, so small reads go one after another on the calling thread.
    * ``conditional_writes``: :meth:`replace_if_unchanged` is a compare-and-swap on the server
      (S3's ``If-Match``) that needs no lock, and a refused one may be the caller's own write
      whose answer was lost; elsewhere callers hold :meth:`exclusive` around read and replace.
    * ``exclusive_across_processes``: of writers in several processes, exactly one creates an
      absent small file (inside :meth:`exclusive`, or by conditional writes). Elsewhere (GCS,
      Azure, SFTP today) two processes may both believe they created it.

    Helpers for implementations (not overridden): :meth:`call`, :meth:`url_of`,
    :meth:`invalidate`, :meth:`raise_if_no_container`.
    """

    real_folders = False
    shared_across_processes = True
    answers_locally = False
    conditional_writes = False
    exclusive_across_processes = False

    def __init__(
        self, fs: fsspec.AbstractFileSystem, retry: RetryPolicy, url_of: Callable[[str], str] | None = None
    ) -> None:
        self.fs = fs
        self.retry = retry
        self._url_of = url_of

    # --- helpers ----------------------------------------------------------------------------

    def url_of(self, path: str) -> str:
        """The URL of ``path``, for messages: in the form the user wrote, where the backend
        belongs to a :class:`~dcp_fsspec.storage.transport.urls.Location` (which passes its ``url_of``)."""
        return self._url_of(path) if self._url_of is not None else self.plain_url(path)

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

    def raise_if_no_container(self, error: FileNotFoundError, url: str) -> None:
        """Raise a StorageError if ``error`` means the bucket (not the file) does not exist."""
        if self.container_missing(error):
            raise StorageError(
                f"cannot use {url}: its bucket does not exist ({error}); create the bucket or fix the URL"
            ) from error

    def invalidate(self, path: str) -> None:
        """Forget cached listings of ``path`` (s3fs caches them; other ranks may have written)."""
        self.fs.invalidate_cache(path)

    # --- the core ---------------------------------------------------------------------------

    @abc.abstractmethod
    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path``, fewer only where the file ends.

        One attempt: the caller retries it under its policy and names the URL. A missing file
        raises ``FileNotFoundError``.
        """

    @abc.abstractmethod
    def read_versioned(self, path: str) -> Versioned:
        """``path``'s bytes and their version, in one read (``Versioned(None)`` if absent).

        For small files (pointer, records, ``.metadata``); read fresh, never from a cache.
        """

    @abc.abstractmethod
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
        """A :class:`FileUpload` that publishes ``path`` whole on commit: until then (and after
        an abort) readers see the old file or none, never part of the new one.

        ``part_size`` and ``multipart_threshold`` (a file up to this size goes in one request)
        tune object stores; ``budget`` bounds the upload data in memory; ``fsync``: local disk,
        where ``syncs`` (from :meth:`file_syncs`) takes the fsync off the commit.
        """

    @abc.abstractmethod
    def find(self, path: str, *, withdirs: bool = False) -> dict[str, dict[str, Any]]:
        """Every file under ``path`` (``path`` itself if it is a file) → its info (``size``,
        ``type``), read fresh; with ``withdirs`` the folders under it too (some stores list
        ``path`` as well). ``{}`` where ``path`` does not exist. A symbolic link is listed
        (type ``"other"``), never followed.
        """

    @abc.abstractmethod
    def remove_files(self, paths: Sequence[str], *, within: str) -> None:
        """Delete the files ``paths`` (all under ``within``) in as few requests as the store
        allows; those already absent are fine, and so are folders among them (from
        ``find(withdirs=True)``), which go where the store keeps them empty. A link on the way is removed, not followed
        (:meth:`remove_link`).

        Raises:
            StorageError: the backend failed; some of ``paths`` may be deleted.
        """

    @abc.abstractmethod
    def replace_if_unchanged(self, path: str, data: bytes, expected: Versioned) -> bool:
        """Write ``data`` to ``path`` if it still holds ``expected`` (from :meth:`read_versioned`;
        ``Versioned(None)``: if it is still absent); False if another write came first.

        Readers see the old bytes or the new, never a mix. Callers hold :meth:`exclusive` around
        the read and this call unless ``conditional_writes``: a backend whose lock excludes
        every other writer may write unconditionally.
        """

    # --- optional: writing ------------------------------------------------------------------

    @classmethod
    def accepts(cls, fs: fsspec.AbstractFileSystem) -> bool:
        """Whether this backend's quirks apply to ``fs`` (the table matched its protocol)."""
        return True

    def plain_url(self, path: str) -> str:
        """The URL fsspec gives ``path`` on this store."""
        return str(self.fs.unstrip_protocol(path))

    def container_missing(self, error: FileNotFoundError) -> bool:
        """Whether ``error`` means the bucket (not the file) does not exist."""
        return False

    def make_folder(self, path: str) -> None:
        """Create ``path`` where folders are real; never on object stores (where it may create a
        bucket)."""
        if self.real_folders:
            self.call("makedirs", path, exist_ok=True)

    def write_small_atomic(
        self,
        path: str,
        data: bytes,
        *,
        fsync: bool = True,
        sync_folder: bool = True,
        syncs: FileSyncs | None = None,
    ) -> None:
        """Write a small file so readers see the old content or the new, never a mix (default:
        one :meth:`new_upload`).

        ``fsync`` (local disk): the file, and its folder unless ``sync_folder`` is false (the
        caller then fsyncs the folder itself, see :meth:`sync_folder`); ``syncs`` as in
        :meth:`new_upload`."""
        upload = self.new_upload(
            path, part_size=MIN_PART_SIZE, budget=ByteBudget(len(data)), fsync=fsync, syncs=syncs
        )
        publish_whole(upload, [data])

    def sync_folder(self, path: str) -> None:
        """Make the renames in ``path`` durable where that is a separate step (local disk)."""

    def file_syncs(self, threads: int) -> FileSyncs | None:
        """Where files are fsynced (local disk): a :class:`~dcp_fsspec.storage.transport.file_syncs.FileSyncs` for one
        save, whose uploads then rename each file into place at once and fsync it on one of
        ``threads`` threads; the caller waits for it before anything names the files. ``None``
        elsewhere (a file is in the store once its upload commits)."""
        return None

    def abort_pending_uploads(self, folder: str) -> None:
        """Abort uploads a killed save left under ``folder`` where the store keeps them (S3)."""

    @contextmanager
    def exclusive(self, folder: str) -> Iterator[None]:
        """Hold off other writers of small files in ``folder`` (default: within this process)."""
        with _PROCESS_LOCK:
            yield

    # --- optional: deleting -----------------------------------------------------------------

    def remove_link(self, path: str, within: str) -> str | None:
        """Remove the symbolic link that stands on ``path`` below ``within``, if one does: the
        link itself, never its target. Returns where it led; ``None`` where there is no link
        (default: stores without links).

        Every delete, rename or write under a folder the caller owns (``within``) calls it
        first: a link there may lead into another run's checkpoint.
        """
        return None

    def remove_trees(self, paths: Sequence[str], *, within: str) -> None:
        """Delete each of ``paths`` (all under ``within``) with everything under it, and the
        unfinished uploads under it where the store keeps them; those already absent are fine.
        A link on the way, or anywhere under a path, is removed itself, never followed.

        Default: :meth:`find` each path with its folders, then one :meth:`remove_files` of all
        (stores whose folders need more than that override it).

        Raises:
            StorageError: the backend failed; some of ``paths`` may be half deleted.
        """
        kept = [path for path in paths if self.remove_link(path, within) is None]
        found = [name for path in kept for name in self.find(path, withdirs=True)]
        if found:
            self.remove_files(found, within=within)

    # --- optional: reading ------------------------------------------------------------------

    def folder_exists(self, path: str) -> bool:
        """Whether the folder ``path`` exists (on object stores: whether anything is stored under
        it). A backend failure raises StorageError: it is not an answer (default: :meth:`find`)."""
        return bool(self.find(path, withdirs=True))

    def link_out_of(self, path: str, folder: str) -> str | None:
        """Where ``path`` really is, if the store resolves it (through a symbolic link) to a place
        outside ``folder``; ``None`` while it stays inside (default: stores without links)."""
        return None

    def range_reader(self) -> RangeReader:
        """A reader for the synchronous ranged reads of one load; the caller closes it."""
        return RangeReader(self)

    def in_place_files(self) -> InPlaceFiles | None:
        """Reads a load fills its targets with directly, closed by the caller (default: none;
        the load streams every record)."""
        return None

    @property
    def async_reads(self) -> bool:
        """Whether ranges are fetched on the filesystem's event loop (s3fs, gcsfs, adlfs)."""
        return False

    async def read_range_async(self, path: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of ``path``, on the event loop (used where :attr:`async_reads`)."""
        return await asyncio.to_thread(self.read_range, path, start, end)
