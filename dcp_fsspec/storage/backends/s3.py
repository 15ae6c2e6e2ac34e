"""S3 through s3fs: multipart uploads with concurrent parts, conditional pointer writes,
ranged GETs read into one buffer, and cleanup of abandoned uploads.

This is the one module that calls s3fs's S3 API directly (``_call_s3``): a file goes up as one
PUT up to a size threshold, else as a multipart upload whose parts are sent concurrently within
a byte budget shared by the whole save; a request body is views of the tensors' own memory,
never a joined copy; over ``http://`` bodies carry an S3 CRC-32 of ours instead of botocore's
SHA-256 signature (still checked by the server), from the same pass that gives each tensor
record its CRC-32; the pointer is replaced with ``If-Match`` on the ETag read
(``If-None-Match: *`` when there was none), so the server settles races between writers (in
the bare form where the server compares bare ETags); a
ranged GET's body is read into one buffer as it arrives (s3fs's ``_cat_file`` keeps the chunks
and joins them: each span twice in memory); a missing bucket is named as such; a body under
16 MiB goes without ``Expect: 100-continue`` (a round trip of its own).
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import io
import itertools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

import fsspec.asyn

from ...errors import DcpFsspecError, StorageError
from ..retry import NO_RETRY, RetryPolicy, causes, http_status
from ..crc import COMBINE_ABOVE, crc32, crc32_combine
from ..file_syncs import FileSyncs
from ..uploads import MIN_PART_SIZE, ByteBudget, FileUpload
from .base import Backend, Versioned

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Buckets known to exist, per filesystem: every key of every save has a backend of its own, and
# one HEAD of the bucket per key was a round trip of each small save for nothing.
_BUCKETS_SEEN: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
# botocore clients that carry our request hooks (:func:`_hook_client`).
_HOOKED_CLIENTS: weakref.WeakSet[Any] = weakref.WeakSet()
# A body at least this long is sent with ``Expect: 100-continue``: only after the server's go-ahead.
EXPECT_CONTINUE_FROM = 16 * 1024 * 1024
# S3's DeleteObjects takes at most this many keys a request.
DELETE_BATCH = 1000
# A removal of more paths than this lists their common folder once, rather than each of them.
LIST_EACH_UP_TO = 8
# Listings and deletions of a removal in flight at once.
REQUESTS_AT_ONCE = 16
# Filesystems whose server compares If-Match with the bare ETag (see replace_if_unchanged).
_BARE_ETAG_SERVERS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


class S3Backend(Backend):
    name = "S3"
    conditional_writes = True
    exclusive_across_processes = True

    def __init__(self, fs: fsspec.AbstractFileSystem, retry: RetryPolicy, url_of: Callable[[str], str] | None = None) -> None:
        super().__init__(fs, retry, url_of)
        _hook_client(fs)

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
                self.fs, "call_s3", "list_objects_v2", Bucket=bucket, Prefix=key.rstrip("/") + "/", MaxKeys=1, url=url
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
        self, path: str, *, part_size: int, budget: ByteBudget, fsync: bool = True, multipart_threshold: int = 0,
        syncs: FileSyncs | None = None,
    ) -> FileUpload:
        return S3MultipartUpload(
            self.fs, path, part_size=part_size, multipart_threshold=multipart_threshold, budget=budget, retry=self.retry
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
            return fsspec.asyn.sync(self.fs.loop, self.retry.call_async, get, url=url)
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
            logger.warning("%s does not support conditional writes; writing it unconditionally", self.url_of(path))
            self.call("pipe_file", path, data)
        self.invalidate(self.fs._parent(path))
        return True

    def _current_etag(self, path: str) -> str | None:
        """The ETag ``path`` has now (None: absent), asked of the server, not of a cache."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            head = self.retry.run(self.fs, "call_s3", "head_object", Bucket=bucket, Key=key, url=self.url_of(path))
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
        self._run(lambda: self._abort_uploads(folder, [folder]), folder, "delete")

    def remove_files(self, paths: Sequence[str], *, within: str) -> None:
        """DeleteObjects: 1,000 keys a request, a few requests at once (no listing)."""
        self._run(lambda: self._delete_keys([self.fs.split_path(p)[1] for p in paths], within), within, "delete")

    def remove_trees(self, paths: Sequence[str], *, within: str) -> None:
        """A listing of each path (several at once), or for many paths one of ``within``;
        DeleteObjects as in :meth:`remove_files`; one listing of the unfinished uploads under
        ``within`` for all of them."""

        async def remove() -> None:
            keys = [self.fs.split_path(p)[1] for p in paths]  # a path may be a file itself
            if len(paths) > LIST_EACH_UP_TO:
                under = tuple(key.rstrip("/") + "/" for key in keys)
                keys += [key for key in await self._list_keys(within) if key.startswith(under)]
            else:
                for listed in await _bounded([self._list_keys(p) for p in paths]):
                    keys += listed
            await self._delete_keys(keys, within)
            await self._abort_uploads(within, paths)

        self._run(remove, within, "delete")
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

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        return await self.retry.call_async(lambda: self.fs._call_s3(method, **kwargs), url=self.url_of(path))

    async def _list_keys(self, folder: str) -> list[str]:
        """Every key under ``folder``, one request per 1,000, fresh (no cache)."""
        bucket, prefix, _ = self.fs.split_path(folder.rstrip("/") + "/")
        keys: list[str] = []
        token: dict[str, str] = {}
        while True:
            page = await self._request("list_objects_v2", folder, Bucket=bucket, Prefix=prefix, **token)
            keys += [item["Key"] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return keys
            token = {"ContinuationToken": page["NextContinuationToken"]}

    async def _delete_keys(self, keys: Sequence[str], within: str) -> None:
        """Delete ``keys`` of ``within``'s bucket; a key the server refused raises, naming it."""
        bucket = self.fs.split_path(within)[0]
        unique = sorted(set(keys))
        batches = [unique[i : i + DELETE_BATCH] for i in range(0, len(unique), DELETE_BATCH)]

        async def delete(batch: list[str]) -> None:
            objects = {"Objects": [{"Key": key} for key in batch], "Quiet": True}
            answer = await self._request("delete_objects", within, Bucket=bucket, Delete=objects)
            errors = answer.get("Errors") or []
            if errors:  # s3fs's own bulk rm drops these silently
                first = errors[0]
                url = self.url_of(f"{bucket}/{first.get('Key')}")
                raise StorageError(
                    f"cannot delete {url}: {first.get('Code')} {first.get('Message')} ({len(errors)} key(s) "
                    "refused); check that the credentials may delete there"
                )

        await _bounded([delete(batch) for batch in batches])

    async def _abort_uploads(self, within: str, folders: Sequence[str]) -> None:
        """Abort the unfinished multipart uploads under any of ``folders`` (best effort, logged)."""
        bucket, prefix, _ = self.fs.split_path(within.rstrip("/") + "/")
        under = tuple(self.fs.split_path(f.rstrip("/") + "/")[1] for f in folders)
        try:
            listing = await self._request("list_multipart_uploads", within, Bucket=bucket, Prefix=prefix)
            await _bounded([
                self._request("abort_multipart_upload", within, Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
                for u in listing.get("Uploads", []) if u["Key"].startswith(under)
            ])  # fmt: skip
        except (OSError, DcpFsspecError) as e:
            logger.warning("could not abort the unfinished uploads under %s: %s", self.url_of(within), e)

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


async def _bounded(coros: Sequence[Coroutine[Any, Any, T]], limit: int = REQUESTS_AT_ONCE) -> list[T]:
    """Await ``coros``, at most ``limit`` at once, in order; the first failure raises."""
    gate = asyncio.Semaphore(limit)

    async def gated(coro: Coroutine[Any, Any, T]) -> T:
        async with gate:
            return await coro

    return list(await asyncio.gather(*(gated(c) for c in coros)))


def _refused_by_condition(error: BaseException) -> bool:
    """412 Precondition Failed, or 409 for a conditional write that raced another one."""
    return any(
        isinstance(e, FileExistsError) or http_status(e)[0] in (409, 412) or http_status(e)[1] == "PreconditionFailed"
        for e in causes(error)
    )


def _conditions_unsupported(error: BaseException) -> bool:
    return any(http_status(e)[0] == 501 or http_status(e)[1] == "NotImplemented" for e in causes(error))


# S3's checksum of a body: CRC-32, the checksum tensor records store too, so the pass that
# computes one gives the other (:mod:`..crc`).
CHECKSUM_ALGORITHM = "CRC32"


def checksum_header(crc: int) -> dict[str, str]:
    """The request parameter that carries a body's CRC-32 ``crc`` (``ChecksumCRC32=…``)."""
    return {f"Checksum{CHECKSUM_ALGORITHM}": base64.b64encode(crc.to_bytes(4, "big")).decode()}


def _hook_client(fs: Any) -> None:
    """Register :func:`_continue_only_for_large_bodies` on ``fs``'s botocore client, once per client.

    Where the client cannot be made here (a configuration it refuses, or a call from within
    fsspec's event loop), nothing is registered: the first request reports the problem as before.
    """
    client = getattr(fs, "_s3", None)
    if client is not None and client in _HOOKED_CLIENTS:
        return
    try:
        client = fsspec.asyn.sync(fs.loop, fs.set_session)
    except Exception as e:  # noqa: BLE001 - the requests that follow raise it in context
        logger.debug("S3 client hooks not registered for %s: %s", fs, e)
        return
    # Last among the handlers of "before-call.s3": after botocore's own, which adds the header.
    client.meta.events.register_last("before-call.s3", _continue_only_for_large_bodies, unique_id="dcp-fsspec-expect")
    _HOOKED_CLIENTS.add(client)


def _continue_only_for_large_bodies(params: dict[str, Any], **_: Any) -> None:
    """botocore's before-call hook: no ``Expect: 100-continue`` on a body under
    :data:`EXPECT_CONTINUE_FROM` bytes.

    botocore asks for the server's go-ahead before every body it can stream (and ours stream),
    whatever its size: a round trip more for each PUT, which across a network is most of a small
    PUT's time (a small save's PUTs come one round after another: five round trips of its 15).
    The go-ahead spares sending a body the server refuses; that is worth a round trip only for
    a body that takes many to send.
    """
    from botocore.utils import determine_content_length  # s3fs brings botocore

    headers = params.get("headers") or {}
    if "Expect" in headers:
        length = determine_content_length(params.get("body"))
        if length is not None and length < EXPECT_CONTINUE_FROM:
            del headers["Expect"]


async def _checksummed_bodies(fs: Any) -> bool:
    """Whether our uploads through ``fs``'s client send a checksum of their own and no SHA-256.

    Left to itself botocore makes a pass of its own over each byte: over ``http://`` it signs
    every body (a SHA-256 pass, ≈1.7 s/GB here, besides the CRC-32 it adds); over ``https://``
    it sends the body ``aws-chunked``, re-framed chunk by chunk with a CRC-32 trailer it
    computes as it reads. Our bodies carry their S3 checksum header instead (the CRC-32 the
    records' pass computed already) and go unsigned as they are: the server still rejects a
    damaged body, and no byte is read twice. Unless the user chose otherwise (client config,
    AWS config file or environment): ``payload_signing_enabled``, or
    ``request_checksum_calculation="when_required"`` (the setting for S3-compatible stores
    that refuse checksums they do not require), leave botocore's way as it is.
    """
    client = await fs.set_session()
    config = client.meta.config
    if config.s3 and config.s3.get("payload_signing_enabled") is not None:
        return False
    if getattr(config, "request_checksum_calculation", None) == "when_required":
        return False
    for operation in ("PutObject", "UploadPart"):
        client.meta.events.register(
            f"before-sign.s3.{operation}", _unsigned_if_checksummed, unique_id=f"dcp-fsspec-unsigned-{operation}"
        )
    return True


def _unsigned_if_checksummed(request: Any, **_: Any) -> None:
    """botocore's before-sign hook: a body with an S3 checksum header goes unsigned."""
    if any(name.lower().startswith("x-amz-checksum-") for name in request.headers):
        from botocore.config import Config  # s3fs brings botocore; not every install has s3fs

        config = request.context["client_config"]
        unsigned = _UNSIGNED_CONFIGS.get(config)
        if unsigned is None:  # once per client: building a Config costs ~2 % of a save's CPU
            unsigned = config.merge(Config(s3={**(config.s3 or {}), "payload_signing_enabled": False}))
            _UNSIGNED_CONFIGS[config] = unsigned
        request.context["client_config"] = unsigned


# A client's config → the same with payload signing off (see _unsigned_if_checksummed).
_UNSIGNED_CONFIGS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


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
    start for a retried attempt.
    """

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
    its bytes in flight. Where the body needs a checksum of ours (:func:`_checksummed_bodies`),
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
            lambda: self.fs._call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs), url=self._url
        )

    async def _send(self, method: str, views: Sequence[memoryview], checksum: dict[str, str], **kwargs: Any) -> Any:
        """``method`` with ``views`` as its body; every attempt reads its own stream of them."""
        bodies: list[_Body] = []

        def attempt() -> Any:
            bodies.append(_Body(views))
            return self.fs._call_s3(method, Bucket=self._bucket, Key=self._key, Body=bodies[-1], **checksum, **kwargs)

        try:
            return await self._retry.call_async(attempt, url=self._url)
        finally:
            # Requests and responses can sit in reference cycles, and the collector is paused
            # during a save: closing the streams lets go of the views now, not at the next pass.
            for body in bodies:
                body.close()

    def _checksummed_here(self) -> bool:
        """Whether this client's uploads carry a checksum of ours (:func:`_checksummed_bodies`)."""
        if self._checksummed is None:
            self._checksummed = self._run(_checksummed_bodies(self.fs)).result()
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
                out = await self._send("upload_part", part.views, checksum, UploadId=self._upload_id, PartNumber=number)
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
