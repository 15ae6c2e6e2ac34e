"""S3 through s3fs: the bucket check, the pointer's conditional writes and ranged reads.

The pointer is replaced with ``If-Match`` on the ETag read (``If-None-Match: *`` where there was
none), so the server settles races between writers. A ranged GET's body is read straight into
the caller's buffer. Uploads are :mod:`~dcp_fsspec.storage.backends.s3_uploads`, removals :mod:`~dcp_fsspec.storage.backends.s3_removal`, and the
botocore client's hooks :mod:`~dcp_fsspec.storage.backends.s3_client`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import fsspec.asyn

from dcp_fsspec.errors import DcpFsspecError, StorageError
from dcp_fsspec.storage.backends.base import Versioned
from dcp_fsspec.storage.backends.generic import FsspecBackend
from dcp_fsspec.storage.backends.s3_client import hook_client
from dcp_fsspec.storage.backends.s3_removal import S3Removal
from dcp_fsspec.storage.backends.s3_uploads import S3MultipartUpload
from dcp_fsspec.storage.backends.uploads import ByteBudget, FileUpload
from dcp_fsspec.storage.transport.concurrency import store_limit
from dcp_fsspec.storage.transport.file_syncs import FileSyncs
from dcp_fsspec.storage.transport.retry import RetryPolicy, causes, http_status

logger = logging.getLogger(__name__)

# Buckets known to exist, per filesystem: every key of every save has a backend of its own, and
# one HEAD of the bucket per key was a round trip of each small save for nothing.
_BUCKETS_SEEN: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
# Filesystems whose server compares If-Match with the bare ETag (see replace_if_unchanged).
_BARE_ETAG_SERVERS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


class S3Backend(FsspecBackend):
    conditional_writes = True
    exclusive_across_processes = True

    def __init__(
        self, fs: fsspec.AbstractFileSystem, retry: RetryPolicy, url_of: Callable[[str], str] | None = None
    ) -> None:
        super().__init__(fs, retry, url_of)
        hook_client(fs)

    @classmethod
    def accepts(cls, fs: fsspec.AbstractFileSystem) -> bool:
        return type(fs).__module__.startswith("s3fs") and callable(getattr(fs, "_call_s3", None))

    def container_missing(self, error: FileNotFoundError) -> bool:
        return any(http_status(e)[1] == "NoSuchBucket" for e in causes(error))

    def make_folder(self, path: str) -> None:
        """S3 has no folders to make; check the bucket exists, so a save to a mistyped bucket
        fails at once with an error that says so, before any data is sent."""
        bucket, _, _ = self.fs.split_path(path)
        seen = _BUCKETS_SEEN.setdefault(self.fs, set())
        if bucket in seen:
            return
        url = self.url_of(path)
        try:
            self.retry.run(self.fs, "call_s3", "head_bucket", Bucket=bucket, url=url)
        except FileNotFoundError as e:
            raise StorageError(
                f"cannot use {url}: its bucket {bucket!r} does not exist ({e}); create the bucket or fix the URL"
            ) from e
        except DcpFsspecError:
            raise
        except OSError as e:
            raise StorageError(f"cannot check the bucket of {url}: {e}") from e
        seen.add(bucket)

    def folder_exists(self, path: str) -> bool:
        """One LIST of the folder's prefix (s3fs's ``info`` first asks HEAD of an object by the
        folder's name, which never exists: a round trip for nothing)."""
        bucket, key, _ = self.fs.split_path(path)
        url = self.url_of(path)
        try:
            listing = self.retry.run(
                self.fs,
                "call_s3",
                "list_objects_v2",
                Bucket=bucket,
                Prefix=key.rstrip("/") + "/",
                MaxKeys=1,
                url=url,
            )
        except FileNotFoundError as e:
            self.raise_if_no_container(e, url)
            return False
        except DcpFsspecError:
            raise
        except OSError as e:
            raise StorageError(f"cannot list {url}: {e}") from e
        return bool(listing.get("Contents") or listing.get("CommonPrefixes"))

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
        return S3MultipartUpload(
            self.fs,
            path,
            part_size=part_size,
            multipart_threshold=multipart_threshold,
            budget=budget,
            retry=self.retry,
        )

    @contextmanager
    def exclusive(self, folder: str) -> Iterator[None]:
        yield  # conditional PUTs settle races on the server

    def read_versioned(self, path: str) -> Versioned:
        bucket, key, _ = self.fs.split_path(path)
        url = self.url_of(path)

        async def get() -> Versioned:
            # One GET: the body and the ETag of the same version (two requests could mix versions).
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                return Versioned(await response["Body"].read(), response["ETag"])
            finally:
                response["Body"].close()

        try:
            return fsspec.asyn.sync(
                self.fs.loop, self.retry.call_async, get, url=url, kind="GET", limit=store_limit(self.fs)
            )
        except FileNotFoundError as e:
            self.raise_if_no_container(e, url)
            return Versioned(None)
        except DcpFsspecError:
            raise
        except OSError as e:
            raise StorageError(f"cannot read {url}: {e}") from e

    def replace_if_unchanged(self, path: str, data: bytes, expected: Versioned) -> bool:
        """Write ``path`` if it still holds the version read (``If-Match``), or if it is still
        absent (``If-None-Match: *``); False when the server refused because it changed.

        Some servers compare ``If-Match`` with the ETag without its quotes (Ceph RGW 16.2), so
        the quoted ETag that GET returned and AWS expects is refused whatever the object holds.
        A refusal while the object still carries the expected ETag is that: the write is sent
        again with the bare ETag, which those servers compare correctly, and so is every later
        one through this filesystem. A refusal of the bare form is a real one.
        """
        if expected.data is None:
            return self._write_if(path, data, IfNoneMatch="*")
        etag = expected.version or ""
        bare = _BARE_ETAG_SERVERS.get(self.fs, False)
        if self._write_if(path, data, IfMatch=etag.strip('"') if bare else etag):
            return True
        if bare or self._current_etag(path) != etag:
            return False
        _BARE_ETAG_SERVERS[self.fs] = True
        logger.info("%s: the server compares If-Match with bare ETags; sending them so", self.url_of(path))
        return self._write_if(path, data, IfMatch=etag.strip('"'))

    def _write_if(self, path: str, data: bytes, **condition: str) -> bool:
        """One conditional PUT; False if the server refused it for its condition."""
        try:
            self.call("pipe_file", path, data, **condition)
        except StorageError as e:
            if _refused_by_condition(e):
                return False
            if not _conditions_unsupported(e):
                raise
            logger.warning(
                "%s does not support conditional writes; writing it unconditionally", self.url_of(path)
            )
            self.call("pipe_file", path, data)
        self.invalidate(self.fs._parent(path))
        return True

    def _current_etag(self, path: str) -> str | None:
        """The ETag ``path`` has now (None: absent), asked of the server, not of a cache."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            head = self.retry.run(
                self.fs, "call_s3", "head_object", Bucket=bucket, Key=key, url=self.url_of(path)
            )
        except FileNotFoundError:
            return None
        except DcpFsspecError:
            raise
        except OSError as e:
            raise StorageError(f"cannot check {self.url_of(path)}: {e}") from e
        return str(head["ETag"])

    def abort_pending_uploads(self, folder: str) -> None:
        """Abort the multipart uploads a killed save left under ``folder`` (invisible, but billed).

        Best effort: without the permission to list them, a bucket lifecycle rule
        (``AbortIncompleteMultipartUpload``) is what cleans them up.
        """
        removal = S3Removal(self)

        async def abort() -> None:
            await removal.abort_uploads(folder, await removal.uploads_under(folder, [folder]))

        self._run(abort, folder, "delete")

    def remove_files(self, paths: Sequence[str], *, within: str) -> None:
        """DeleteObjects: 1,000 keys a request, a few requests at once (no listing)."""
        self._run(
            lambda: S3Removal(self).delete_keys([self.fs.split_path(p)[1] for p in paths], within),
            within,
            "delete",
        )

    def remove_trees(self, paths: Sequence[str], *, within: str) -> None:
        """Two round trips: a listing of each path (or for many paths one of ``within``) and one
        of the unfinished uploads under ``within``, at once; then DeleteObjects as in
        :meth:`remove_files` and the aborts, at once."""
        self._run(lambda: S3Removal(self).trees(paths, within), within, "delete")
        self.invalidate(within)

    def _run(self, make: Callable[[], Any], path: str, verb: str) -> Any:
        """``make()``'s coroutine on the filesystem's loop; a failure is a StorageError naming ``path``."""
        url = self.url_of(path)
        try:
            return fsspec.asyn.sync(self.fs.loop, make)
        except FileNotFoundError as e:
            self.raise_if_no_container(e, url)
            raise StorageError(f"cannot {verb} under {url}: {e}") from e
        except DcpFsspecError:
            raise
        except OSError as e:
            raise StorageError(f"cannot {verb} under {url}: {e}") from e

    async def read_range_async(self, path: str, start: int, end: int) -> bytes | bytearray:
        out = bytearray(end - start)
        got = await self.read_range_into_async(path, start, memoryview(out))
        # The object ends before the span does: the caller reports it truncated.
        return out if got == len(out) else bytes(out[:got])

    async def read_range_into_async(self, path: str, start: int, view: memoryview) -> int:
        """The body goes straight into ``view`` (a target tensor's memory, or a fetch's buffer)."""
        bucket, key, version = self.fs.split_path(path)
        response = await self.fs._call_s3(
            "get_object",
            Bucket=bucket,
            Key=key,
            Range=f"bytes={start}-{start + len(view) - 1}",
            **({"VersionId": version} if version else {}),
        )
        body = response["Body"]
        got = 0
        try:
            while got < len(view):
                n = await body.readinto(view[got:])
                if not n:
                    break
                got += n
        finally:
            body.close()
        return got


def _refused_by_condition(error: BaseException) -> bool:
    """412 Precondition Failed, or 409 for a conditional write that raced another one."""
    return any(
        isinstance(e, FileExistsError)
        or http_status(e)[0] in (409, 412)
        or http_status(e)[1] == "PreconditionFailed"
        for e in causes(error)
    )


def _conditions_unsupported(error: BaseException) -> bool:
    return any(http_status(e)[0] == 501 or http_status(e)[1] == "NotImplemented" for e in causes(error))
