"""S3 uploads: one PUT up to a size threshold, else a multipart upload of concurrent parts.

A request body is views of the caller's buffers (tensor memory), never a joined copy. Parts in
flight stay within the byte budget the whole save shares. Where the client allows it, each body
carries the CRC-32 of ours that the records' pass computes too.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import io
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from dcp_fsspec.storage.backends.s3_client import checksummed_bodies
from dcp_fsspec.storage.backends.uploads import MIN_PART_SIZE, ByteBudget, FileUpload
from dcp_fsspec.storage.format.crc import COMBINE_ABOVE, crc32, crc32_combine
from dcp_fsspec.storage.transport.concurrency import store_limit
from dcp_fsspec.storage.transport.retry import NO_RETRY, RetryPolicy

# S3's checksum of a body: CRC-32, the checksum tensor records store too, so the pass that
# computes one gives the other (:mod:`~dcp_fsspec.storage.format.crc`).
CHECKSUM_ALGORITHM = "CRC32"


def checksum_header(crc: int) -> dict[str, str]:
    """The request parameter that carries a body's CRC-32 ``crc`` (``ChecksumCRC32=…``)."""
    return {f"Checksum{CHECKSUM_ALGORITHM}": base64.b64encode(crc.to_bytes(4, "big")).decode()}


class _Length:
    """What :meth:`_Body.getbuffer` gives aiohttp, which only asks it for the body's length."""

    def __init__(self, size: int) -> None:
        self._size = size

    def __len__(self) -> int:
        return self._size

    def __enter__(self) -> _Length:
        return self

    def __exit__(self, *_: object) -> None:
        pass


class _Body(io.BytesIO):
    """The stream one attempt of a request reads its body from: views of the file's buffers
    (tensor memory, record headers), read in place, never joined into one copy.

    aiohttp takes a ``BytesIO`` as a stream of known length: it asks ``getbuffer()`` for the
    length, then sends the body in 256 KiB ``read``s. Each read here is a view of one of the
    buffers, never crossing into the next (a shorter read is still a chunk to aiohttp and to
    botocore), which aiohttp and the socket take as they take bytes; botocore seeks back to the
    start for a retried attempt, and :mod:`~dcp_fsspec.storage.backends.s3_client` for a call
    that s3fs makes again with it (``whole_each_call``).
    """

    whole_each_call = True

    def __init__(self, views: Sequence[memoryview]) -> None:
        super().__init__()
        self._views = list(views)
        self._starts = list(itertools.accumulate((v.nbytes for v in self._views), initial=0))
        self._pos = 0

    def getbuffer(self) -> Any:  # only its length is asked for (see the class docstring)
        return _Length(self._starts[-1])

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._starts[-1]}[whence]
        self._pos = min(max(base + offset, 0), self._starts[-1])
        return self._pos

    def read(self, size: int | None = -1) -> Any:  # a memoryview: bytes' interface, no copy
        if self._pos >= self._starts[-1]:
            return b""
        if size is None or size < 0:  # not on the upload path: botocore and aiohttp read in chunks
            rest = [bytes(self.read(self._starts[-1]))]
            while chunk := self.read(self._starts[-1]):
                rest.append(bytes(chunk))
            return b"".join(rest)
        k = bisect.bisect_right(self._starts, self._pos) - 1
        offset = self._pos - self._starts[k]
        chunk = self._views[k][offset : offset + size]
        self._pos += chunk.nbytes
        return chunk

    def close(self) -> None:
        self._views = []
        self._starts = [0]
        super().close()


class _Part:
    """The buffers of one request body (a part, or the whole object) and their CRC-32."""

    def __init__(self) -> None:
        self.views: list[memoryview] = []
        self.size = 0
        self.crc = 0


class S3MultipartUpload(FileUpload):
    """One S3 object: a single PUT up to ``multipart_threshold`` bytes, else a multipart upload
    whose parts are sent concurrently.

    ``write`` keeps views of the caller's buffers (tensor memory stays alive for the whole save)
    and cuts them into parts as they come; a request body is those views, sent as they are, so
    the upload copies nothing. A part is sent only once the shared :class:`ByteBudget` allows
    its bytes in flight. Where the body needs a checksum of ours (:func:`checksummed_bodies`),
    each piece's CRC-32 is computed as it is cut, and the same pass gives
    :meth:`write_checksummed` the CRC of a tensor's bytes.
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        part_size: int,
        multipart_threshold: int,
        budget: ByteBudget,
        retry: RetryPolicy = NO_RETRY,
    ) -> None:
        super().__init__(fs, path)
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_size = max(part_size, MIN_PART_SIZE)
        self._threshold = max(multipart_threshold, 0)
        self._budget = budget
        self._retry = retry
        self._url = fs.unstrip_protocol(path)
        # Requests at once to the store, shared with every upload and read of this process.
        self._limit = store_limit(fs)
        # Parts are cut at multiples of the part size as the bytes arrive: complete ones wait in
        # _ready until the upload is known to be multipart, the last one fills in _open.
        self._ready: deque[_Part] = deque()
        self._open = _Part()
        self._pending_size = 0
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        # The first part that failed: later parts are not sent, so the error surfaces in the
        # time of one part's retries rather than after every remaining part failed too.
        self._failed: BaseException | None = None
        self._checksummed: bool | None = None  # known at the first write

    def _run(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    async def _request(self, method: str, **kwargs: Any) -> Any:
        return await self._retry.call_async(
            lambda: self.fs._call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs),
            url=self._url,
            limit=self._limit,
        )

    async def _send(
        self, method: str, views: Sequence[memoryview], checksum: dict[str, str], **kwargs: Any
    ) -> Any:
        """``method`` with ``views`` as its body; every attempt reads its own stream of them."""
        bodies: list[_Body] = []

        def attempt() -> Any:
            bodies.append(_Body(views))
            return self.fs._call_s3(
                method, Bucket=self._bucket, Key=self._key, Body=bodies[-1], **checksum, **kwargs
            )

        try:
            return await self._retry.call_async(attempt, url=self._url, kind="PUT", limit=self._limit)
        finally:
            # Requests and responses can sit in reference cycles, and the collector is paused
            # during a save: closing the streams lets go of the views now, not at the next pass.
            for body in bodies:
                body.close()

    def _checksummed_here(self) -> bool:
        """Whether this client's uploads carry a checksum of ours (:func:`checksummed_bodies`)."""
        if self._checksummed is None:
            self._checksummed = self._run(checksummed_bodies(self.fs)).result()
        return self._checksummed

    def _checksum(self, part: _Part) -> dict[str, str]:
        """The checksum parameter of a request with body ``part`` (none where botocore adds its own)."""
        return checksum_header(part.crc) if self._checksummed_here() else {}

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self._run(self._request(method, **kwargs)).result()

    def write(self, buffers: Iterable[bytes | memoryview]) -> None:
        for buf in buffers:
            self._append(memoryview(buf).cast("B"), crc_wanted=False)
        self._send_ready()

    def write_checksummed(self, data: memoryview) -> int:
        crc = self._append(memoryview(data).cast("B"), crc_wanted=True)
        self._send_ready()
        return crc

    def _append(self, view: memoryview, *, crc_wanted: bool) -> int:
        """Add ``view`` to the parts, cut where parts end; its CRC-32 if ``crc_wanted``, else 0.

        One CRC pass per piece serves both the part's checksum and ``view``'s: a large piece's
        CRC is combined into each (:func:`crc32_combine`); a small one is cheaper to pass twice.
        """
        checksummed = self._checksummed_here()
        crc = 0
        while view.nbytes:
            part = self._open
            room = self._part_size - part.size
            piece, view = view[:room], view[room:]
            if piece.nbytes < COMBINE_ABOVE:
                crc = crc32(piece, crc) if crc_wanted else 0
                part.crc = crc32(piece, part.crc) if checksummed else 0
            elif crc_wanted or checksummed:
                piece_crc = crc32(piece, 0)
                crc = crc32_combine(crc, piece_crc, piece.nbytes) if crc_wanted else 0
                part.crc = crc32_combine(part.crc, piece_crc, piece.nbytes) if checksummed else 0
            part.views.append(piece)
            part.size += piece.nbytes
            self._pending_size += piece.nbytes
            self.size += piece.nbytes
            if part.size == self._part_size:
                self._ready.append(part)
                self._open = _Part()
        return crc

    def _send_ready(self) -> None:
        """Send the complete parts once the file is known to be larger than one PUT takes."""
        if self._upload_id is not None or self._pending_size > self._threshold:
            while self._ready:
                self._send_part(self._ready.popleft())

    def _send_part(self, part: _Part) -> None:
        """Start uploading ``part`` as the next part."""
        if self._failed is not None:
            raise self._failed
        if self._upload_id is None:
            algorithm = {"ChecksumAlgorithm": CHECKSUM_ALGORITHM} if self._checksummed_here() else {}
            self._upload_id = self._call("create_multipart_upload", **algorithm)["UploadId"]
        number = len(self._parts) + 1
        # The body copies nothing, but its bytes in flight are what the socket buffers and the
        # server hold on to: the budget bounds them, and holds back the writer thread meanwhile.
        self._budget.acquire(part.size)
        self._pending_size -= part.size
        checksum = self._checksum(part)

        async def upload() -> dict[str, Any]:
            try:
                out = await self._send(
                    "upload_part", part.views, checksum, UploadId=self._upload_id, PartNumber=number
                )
                return {"PartNumber": number, "ETag": out["ETag"], **checksum}
            except BaseException as e:
                self._failed = self._failed or e
                raise
            finally:
                part.views.clear()  # the tensors' memory is the caller's again
                self._budget.release(part.size)

        self._parts.append(self._run(upload()))

    def commit(self) -> None:
        if self._upload_id is None:
            whole = _Part()
            for part in (*self._ready, self._open):
                whole.views += part.views
                whole.crc = crc32_combine(whole.crc, part.crc, part.size)
                whole.size += part.size
            self._budget.acquire(whole.size)
            try:
                self._run(self._send("put_object", whole.views, self._checksum(whole))).result()
            finally:
                self._budget.release(whole.size)
        else:
            if self._open.size:
                self._send_part(self._open)
            parts = [f.result() for f in self._parts]
            self._call(
                "complete_multipart_upload",
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        self._ready.clear()
        self._open = _Part()
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        for f in self._parts:
            f.cancel()
        if self._upload_id is not None:
            try:
                self._call("abort_multipart_upload", UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - the original error matters more; S3 expires it
                pass
