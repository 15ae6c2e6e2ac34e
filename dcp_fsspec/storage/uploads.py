"""Writing one whole file to a backend: durably, atomically, and with bounded memory.

A :class:`FileUpload` receives a file's bytes as a sequence of buffers and makes the file
appear only when :meth:`FileUpload.commit` succeeds:

* local disk: a temporary name in the same folder, ``fsync``, ``rename`` (the folder is fsynced
  by the caller once per batch of files);
* S3 (s3fs): a single PUT for small files, else a multipart upload whose parts go up
  concurrently, bounded by a byte budget shared by every upload of the save; each request is
  retried by the save's :class:`~.retry.RetryPolicy`, and a failed part stops the upload;
* anything else: fsspec's own buffered file (``fs.open(path, "wb")``), which object stores
  publish atomically on close.

On error, :meth:`FileUpload.abort` removes what was started (the temporary file, the pending
multipart upload). Buffers handed to :meth:`write` may be views of tensor memory: they are
copied at most once (into a part), never kept after ``write`` returns for local files.
"""

from __future__ import annotations

import abc
import asyncio
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import StorageError
from .retry import NO_RETRY, RetryPolicy

# S3 rejects multipart parts under 5 MiB (except the last).
MIN_PART_SIZE = 5 * 1024 * 1024


class ByteBudget:
    """A counting semaphore in bytes: how much upload data may be in flight at once."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        # A request larger than the whole budget proceeds alone rather than deadlocking.
        n = min(n, self._limit)
        with self._cond:
            self._cond.wait_for(lambda: self._used + n <= self._limit)
            self._used += n

    def release(self, n: int) -> None:
        n = min(n, self._limit)
        with self._cond:
            self._used -= n
            self._cond.notify_all()


class FileUpload(abc.ABC):
    """Base class: the bytes of one file, published on :meth:`commit`."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs = fs
        self.path = path
        self.size = 0

    @abc.abstractmethod
    def write(self, buffers: Iterable[bytes | memoryview]) -> None:
        """Append ``buffers`` to the file (may block while earlier parts upload)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Publish the file under its final name; after this it is complete or absent."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard what was written; the final name is left untouched."""


class LocalUpload(FileUpload):
    """Temporary file + fsync + rename: the final name holds all the bytes or does not exist."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, *, fsync: bool = True) -> None:
        super().__init__(fs, path)
        self._fsync = fsync
        self._tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        self._file = open(self._tmp, "wb", buffering=0)
        # Buffers not yet written, by reference: small records go out many per writev() call
        # rather than three write() calls each (10,000 small tensors: 30,000 → ~100 syscalls).
        self._pending: list[memoryview] = []
        self._pending_bytes = 0

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

    def commit(self) -> None:
        self._flush()
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


class RenameUpload(FileUpload):
    """A temporary name, then a rename: for remote filesystems with real folders (SFTP).

    Written in small pieces: OpenSSH drops the connection on single writes of many MiB.
    """

    _PIECE = 256 * 1024

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
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


def has_real_folders(fs: fsspec.AbstractFileSystem) -> bool:
    """Filesystems where a file's folder must exist and a rename is atomic (local disk, SFTP)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return isinstance(fs, LocalFileSystem) or bool({"sftp", "ssh"} & set(protocols))


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


def is_s3fs(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is s3fs (we then call its S3 API directly: multipart, conditional writes)."""
    return type(fs).__module__.startswith("s3fs") and hasattr(fs, "_call_s3")


def upload_factory(
    fs: fsspec.AbstractFileSystem,
    *,
    part_size: int,
    budget: ByteBudget,
    fsync: bool = True,
    retry: RetryPolicy = NO_RETRY,
) -> Callable[[str], FileUpload]:
    """The way this backend writes whole files, as a function from path to :class:`FileUpload`.

    ``retry`` applies to S3's requests; other object stores' buffered files rely on their
    driver's retries (a file streamed from tensor memory cannot be replayed part by part).
    """
    if isinstance(fs, LocalFileSystem):
        return lambda path: LocalUpload(fs, path, fsync=fsync)
    if is_s3fs(fs):
        return lambda path: S3MultipartUpload(fs, path, part_size=part_size, budget=budget, retry=retry)
    if has_real_folders(fs):
        return lambda path: RenameUpload(fs, path)
    return lambda path: BufferedUpload(fs, path, block_size=max(part_size, MIN_PART_SIZE))


def write_whole_file(
    fs: fsspec.AbstractFileSystem, path: str, data: bytes, *, fsync: bool = True, retry: RetryPolicy = NO_RETRY
) -> None:
    """Write a small file atomically: temp+(fsync)+rename where there are folders, else one PUT (retried)."""
    if has_real_folders(fs):
        upload: FileUpload = LocalUpload(fs, path, fsync=fsync) if isinstance(fs, LocalFileSystem) else RenameUpload(fs, path)
        try:
            upload.write([data])
            upload.commit()
        except BaseException:
            upload.abort()
            raise
        if fsync and isinstance(fs, LocalFileSystem):
            fsync_dir(os.path.dirname(path))
        return
    retry.run(fs, "pipe_file", path, data, url=fs.unstrip_protocol(path))


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
