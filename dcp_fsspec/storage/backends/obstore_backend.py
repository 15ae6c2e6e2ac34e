"""S3 and Azure through obstore (Rust's object_store): conditional writes, ranged reads, bulk deletes.

The pointer is replaced with ``If-Match`` on the ETag read (``If-None-Match: *`` where there was
none), as on s3fs, so the server settles races between writers. Listings are one flat LIST, and
removals one bulk DELETE per 1,000 keys. Requests are tried as botocore tries them under s3fs
(:func:`~dcp_fsspec.storage.backends.obstore_filesystem.tried`), and the retry policy retries on top.
"""

from __future__ import annotations

import posixpath
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import fsspec
import obstore

from dcp_fsspec.errors import DcpFsspecError, StorageError
from dcp_fsspec.storage.backends.base import Versioned
from dcp_fsspec.storage.backends.generic import FsspecBackend
from dcp_fsspec.storage.backends.obstore_filesystem import ObstoreFileSystem, as_os_error, tried, tried_async
from dcp_fsspec.storage.backends.obstore_uploads import ObstoreUpload
from dcp_fsspec.storage.backends.uploads import ByteBudget, FileUpload
from dcp_fsspec.storage.transport.file_syncs import FileSyncs

T = TypeVar("T")

# The chunks a ranged read into given memory is copied in: small enough that the reads in
# flight hold little memory, large enough that Python handles few of them.
STREAM_CHUNK = 1024 * 1024


class ObstoreBackend(FsspecBackend):
    conditional_writes = True
    exclusive_across_processes = True
    fs: ObstoreFileSystem

    @classmethod
    def accepts(cls, fs: fsspec.AbstractFileSystem) -> bool:
        return isinstance(fs, ObstoreFileSystem)

    # --- the core ---------------------------------------------------------------------------

    def read_range(self, path: str, start: int, end: int) -> bytes:
        store, key = self.fs.store(path)
        return bytes(tried(lambda: obstore.get_range(store, key, start=start, end=end)))

    def read_versioned(self, path: str) -> Versioned:
        store, key = self.fs.store(path)

        def get() -> Versioned:
            # One GET: the body and the ETag of the same version.
            result = obstore.get(store, key)
            return Versioned(bytes(result.bytes()), result.meta["e_tag"])

        try:
            return self._call("read", path, get)
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
        return ObstoreUpload(
            self.fs,
            path,
            url=self.url_of(path),
            part_size=part_size,
            multipart_threshold=multipart_threshold,
            budget=budget,
            retry=self.retry,
        )

    def find(self, path: str, *, withdirs: bool = False) -> dict[str, dict[str, Any]]:
        """One flat listing of the prefix (1,000 keys a request); ``path`` itself if it is a file."""
        self.invalidate(path)
        store, key = self.fs.store(path)
        bucket = self.fs._split_path(path)[0]
        root = key.rstrip("/")
        found: dict[str, dict[str, Any]] = {}
        for meta in self._call("list", path, lambda: _listed(store, root)):
            name = f"{bucket}/{meta['path']}"
            found[name] = {"name": name, "size": meta["size"], "type": "file"}
        if not found:
            return self._file_alone(path)
        if withdirs:
            for name in list(found):
                folder = posixpath.dirname(name)
                while len(folder) > len(path.rstrip("/")):
                    found.setdefault(folder, {"name": folder, "size": 0, "type": "directory"})
                    folder = posixpath.dirname(folder)
        return dict(sorted(found.items()))

    def _file_alone(self, path: str) -> dict[str, dict[str, Any]]:
        store, key = self.fs.store(path)
        try:
            head = self._call("check", path, lambda: obstore.head(store, key))
        except FileNotFoundError:
            return {}
        name = path.rstrip("/")
        return {name: {"name": name, "size": head["size"], "type": "file"}}

    def remove_files(self, paths: Sequence[str], *, within: str) -> None:
        """Bulk DELETEs, 1,000 keys a request (obstore's delete of a list); absent keys are fine."""
        by_bucket: dict[str, list[str]] = defaultdict(list)
        for path in paths:
            bucket, key = self.fs._split_path(path)
            by_bucket[bucket].append(key)
        for bucket, keys in by_bucket.items():
            store = self.fs.bucket_store(bucket)
            try:
                self._call("delete", within, lambda: obstore.delete(store, keys))
            except FileNotFoundError:  # Azure's bulk delete refuses absent keys: one by one
                for key in keys:
                    self._delete_if_present(store, key, within)
        self.invalidate(within)

    def _delete_if_present(self, store: Any, key: str, within: str) -> None:
        try:
            self._call("delete", within, lambda: obstore.delete(store, key))
        except FileNotFoundError:
            pass  # already gone

    def replace_if_unchanged(self, path: str, data: bytes, expected: Versioned) -> bool:
        """Write ``path`` if it still holds the version read (``If-Match``), or if it is still
        absent (``If-None-Match: *``); False when the server refused because it changed."""
        store, key = self.fs.store(path)
        mode: Any = "create" if expected.data is None else {"e_tag": expected.version or ""}
        try:
            self._call("write", path, lambda: obstore.put(store, key, data, mode=mode))
        except (FileExistsError, StorageError) as e:
            if isinstance(e, FileExistsError) or isinstance(e.__cause__, FileExistsError):
                return False
            raise
        self.invalidate(self.fs._parent(path))
        return True

    # --- where obstore has a cheaper way than the defaults ----------------------------------

    @contextmanager
    def exclusive(self, folder: str) -> Iterator[None]:
        yield  # conditional PUTs settle races on the server

    def write_small_atomic(
        self,
        path: str,
        data: bytes,
        *,
        fsync: bool = True,
        sync_folder: bool = True,
        syncs: FileSyncs | None = None,
    ) -> None:
        store, key = self.fs.store(path)
        self._call("write", path, lambda: obstore.put(store, key, data, use_multipart=False))
        self.invalidate(self.fs._parent(path))

    def make_folder(self, path: str) -> None:
        """S3 has no folders to make; check the bucket exists (one LIST of one key), so a save to
        a mistyped bucket fails at once with an error that says so."""
        store, key = self.fs.store(path)
        try:
            self._call("check the bucket of", path, lambda: _listed(store, key, limit=1))
        except FileNotFoundError as e:
            raise StorageError(
                f"cannot use {self.url_of(path)}: its bucket does not exist ({e}); "
                "create the bucket or fix the URL"
            ) from e

    def folder_exists(self, path: str) -> bool:
        store, key = self.fs.store(path)
        try:
            return bool(self._call("list", path, lambda: _listed(store, key.rstrip("/"), limit=1)))
        except FileNotFoundError:
            return False

    async def read_range_async(self, path: str, start: int, end: int) -> bytes | bytearray:
        """A view of obstore's own buffer, not a copy of it: every reader of fetched spans
        (records decoded as they arrive, copies, integrity checks) reads through a memoryview."""
        store, key = self.fs.store(path)
        data = await tried_async(lambda: obstore.get_range_async(store, key, start=start, end=end))
        return memoryview(data)  # type: ignore[return-value]  # read as bytes, never changed

    async def read_range_into_async(self, path: str, start: int, view: memoryview) -> int:
        """The body's chunks are copied into ``view`` as they arrive: memory held per read is
        one chunk, not the whole range (obstore cannot read into given memory)."""
        store, key = self.fs.store(path)
        got = 0
        options: Any = {"range": (start, start + len(view))}
        result = await tried_async(lambda: obstore.get_async(store, key, options=options))
        try:
            async for chunk in result.stream(min_chunk_size=STREAM_CHUNK):
                piece = memoryview(chunk)
                view[got : got + piece.nbytes] = piece
                got += piece.nbytes
        except obstore.exceptions.BaseError as e:
            raise as_os_error(e) from e
        return got

    # --- helpers ----------------------------------------------------------------------------

    def _call(self, verb: str, path: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried; absence passes through, any other failure is a StorageError naming ``path``."""
        url = self.url_of(path)
        try:
            return self.retry.call(lambda: tried(fn), url=url)
        except (FileNotFoundError, DcpFsspecError):
            raise
        except OSError as e:
            raise StorageError(f"cannot {verb} {url}: {e}") from e


def _listed(store: Any, prefix: str, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Every object under ``prefix`` (a folder: ``a`` lists ``a/…``, not ``ab``); the first
    ``limit`` where given."""
    out: list[dict[str, Any]] = []
    for chunk in obstore.list(store, prefix or None, chunk_size=limit or 1000):
        out.extend(chunk)
        if limit is not None and len(out) >= limit:
            break
    return out
