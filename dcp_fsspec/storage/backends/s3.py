"""S3 through s3fs: multipart uploads with concurrent parts, conditional pointer writes,
ranged GETs read into one buffer, and cleanup of abandoned uploads.

This is the one module that calls s3fs's S3 API directly (``_call_s3``): a file goes up as one
PUT when small, else as a multipart upload whose parts are sent concurrently within a byte
budget shared by the whole save; the pointer is replaced with ``If-Match`` on the ETag read
(``If-None-Match: *`` when there was none), so the server settles races between writers; a
ranged GET's body is read into one buffer as it arrives (s3fs's ``_cat_file`` keeps the chunks
and joins them: each span twice in memory); a missing bucket is named as such.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import fsspec.asyn

from ...errors import DcpFsspecError, StorageError
from ..retry import NO_RETRY, RetryPolicy, causes, http_status
from ..uploads import MIN_PART_SIZE, ByteBudget, FileUpload
from .base import Backend, Versioned

logger = logging.getLogger(__name__)


class S3Backend(Backend):
    name = "S3"
    conditional_writes = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._buckets_seen: set[str] = set()  # by make_folder: checked once per backend

    @classmethod
    def accepts(cls, fs: fsspec.AbstractFileSystem) -> bool:
        return type(fs).__module__.startswith("s3fs") and callable(getattr(fs, "_call_s3", None))

    def container_missing(self, error: FileNotFoundError) -> bool:
        return any(http_status(e)[1] == "NoSuchBucket" for e in causes(error))

    def make_folder(self, path: str) -> None:
        """S3 has no folders to make; check the bucket exists, so a save to a mistyped bucket
        fails at once with an error that says so, before any data is sent."""
        bucket, _, _ = self.fs.split_path(path)
        if bucket in self._buckets_seen:
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
        self._buckets_seen.add(bucket)

    def new_upload(self, path: str, *, part_size: int, budget: ByteBudget, fsync: bool = True) -> FileUpload:
        return S3MultipartUpload(self.fs, path, part_size=part_size, budget=budget, retry=self.retry)

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
            return fsspec.asyn.sync(self.fs.loop, self.retry.call_async, get, url=url)
        except FileNotFoundError as e:
            self.raise_if_no_container(e, url)
            return Versioned(None)
        except DcpFsspecError:
            raise
        except OSError as e:
            raise StorageError(f"cannot read {url}: {e}") from e

    def replace_if_unchanged(self, path: str, data: bytes, expected: Versioned) -> bool:
        condition = {"IfMatch": expected.version} if expected.data is not None else {"IfNoneMatch": "*"}
        try:
            self.call("pipe_file", path, data, **condition)
        except StorageError as e:
            if _refused_by_condition(e):
                return False
            if not _conditions_unsupported(e):
                raise
            logger.warning("%s does not support conditional writes; writing it unconditionally", self.url_of(path))
            self.call("pipe_file", path, data)
        self.invalidate(self.fs._parent(path))
        return True

    def abort_pending_uploads(self, folder: str) -> None:
        """Abort the multipart uploads a killed save left under ``folder`` (invisible, but billed).

        Best effort: without the permission to list them, a bucket lifecycle rule
        (``AbortIncompleteMultipartUpload``) is what cleans them up.
        """
        bucket, prefix, _ = self.fs.split_path(folder.rstrip("/") + "/")
        url = self.url_of(folder)
        try:
            listing = self.retry.run(self.fs, "call_s3", "list_multipart_uploads", Bucket=bucket, Prefix=prefix, url=url)
            for upload in listing.get("Uploads", []):
                key, upload_id = upload["Key"], upload["UploadId"]
                self.retry.run(self.fs, "call_s3", "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, url=url)
        except (OSError, DcpFsspecError) as e:
            logger.warning("could not abort the unfinished uploads under %s: %s", url, e)

    async def read_range_async(self, path: str, start: int, end: int) -> bytes | bytearray:
        bucket, key, version = self.fs.split_path(path)
        response = await self.fs._call_s3(
            "get_object",
            Bucket=bucket,
            Key=key,
            Range=f"bytes={start}-{end - 1}",
            **({"VersionId": version} if version else {}),
        )
        body = response["Body"]
        size = end - start
        out = bytearray(size)
        view = memoryview(out)
        got = 0
        try:
            while got < size:
                n = await body.readinto(view[got:])
                if not n:  # the object ends before the span does: the caller reports it truncated
                    return bytes(view[:got])
                got += n
        finally:
            body.close()
        return out


def _refused_by_condition(error: BaseException) -> bool:
    """412 Precondition Failed, or 409 for a conditional write that raced another one."""
    return any(
        isinstance(e, FileExistsError) or http_status(e)[0] in (409, 412) or http_status(e)[1] == "PreconditionFailed"
        for e in causes(error)
    )


def _conditions_unsupported(error: BaseException) -> bool:
    return any(http_status(e)[0] == 501 or http_status(e)[1] == "NotImplemented" for e in causes(error))


class S3MultipartUpload(FileUpload):
    """s3fs multipart upload with concurrent parts; a single PUT when the file is small."""

    def __init__(
        self, fs: Any, path: str, *, part_size: int, budget: ByteBudget, retry: RetryPolicy = NO_RETRY
    ) -> None:
        super().__init__(fs, path)
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_size = max(part_size, MIN_PART_SIZE)
        self._budget = budget
        self._retry = retry
        self._url = fs.unstrip_protocol(path)
        # Views into the caller's buffers (tensor memory stays alive for the whole save), joined
        # into one bytes object per part: the only copy the upload makes.
        self._pending: list[memoryview] = []
        self._pending_size = 0
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        # The first part that failed: later parts are not sent, so the error surfaces in the
        # time of one part's retries rather than after every remaining part failed too.
        self._failed: BaseException | None = None

    def _run(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    async def _request(self, method: str, **kwargs: Any) -> Any:
        return await self._retry.call_async(
            lambda: self.fs._call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs), url=self._url
        )

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self._run(self._request(method, **kwargs)).result()

    def write(self, buffers: Iterable[bytes | memoryview]) -> None:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            self.size += view.nbytes
            while view.nbytes:
                take = min(view.nbytes, self._part_size - self._pending_size)
                self._pending.append(view[:take])
                self._pending_size += take
                view = view[take:]
                if self._pending_size == self._part_size:
                    self._send_pending()

    def _take_pending(self) -> bytearray:
        # A bytearray, not bytes: botocore wraps a bytes body in BytesIO, and aiohttp sends a
        # BytesIO through getbuffer(), which copies the whole part once more; a bytearray goes
        # to the socket as it is (-20 % of a save's CPU on the benchmark's server).
        body = bytearray().join(self._pending)
        self._pending, self._pending_size = [], 0
        return body

    def _send_pending(self) -> None:
        # The budget is taken before the part is joined: the join is the upload's only copy of
        # the data, and it must not exist before the budget allows it.
        size = self._pending_size
        self._budget.acquire(size)
        try:
            self._send_part(self._take_pending())
        except BaseException:
            self._budget.release(size)
            raise

    def _send_part(self, body: bytearray) -> None:
        """Start uploading ``body`` as the next part; the caller took its budget, released here."""
        if self._failed is not None:
            raise self._failed
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        number = len(self._parts) + 1

        async def upload() -> dict[str, Any]:
            try:
                out = await self._request("upload_part", UploadId=self._upload_id, PartNumber=number, Body=body)
                return {"PartNumber": number, "ETag": out["ETag"]}
            except BaseException as e:
                self._failed = self._failed or e
                raise
            finally:
                self._budget.release(len(body))

        self._parts.append(self._run(upload()))

    def commit(self) -> None:
        if self._upload_id is None:
            self._call("put_object", Body=self._take_pending())
        else:
            if self._pending_size:
                self._send_pending()
            parts = [f.result() for f in self._parts]
            self._call(
                "complete_multipart_upload",
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        for f in self._parts:
            f.cancel()
        if self._upload_id is not None:
            try:
                self._call("abort_multipart_upload", UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - the original error matters more; S3 expires it
                pass
