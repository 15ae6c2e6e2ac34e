"""The benchmark's S3: moto on 127.0.0.1 behind a WSGI layer that counts and serves ranges.

Counting happens at the server, so it sees every client (s3fs, botocore, the CRT client of
s3torchconnector) in every worker process the same way: per S3 operation, the number of
requests, bytes received and sent, and seconds spent handling them. Workers read the counters
from ``GET /__bench__/counters`` (not a valid bucket name, so no S3 request can reach it)
before and after the phase they time.

Stock moto answers a ranged GET by reading the whole object and slicing it, so every ranged
read costs a full-object read and a design built on ranged reads looks slow. With
``fast_ranges`` on, a single-range GET (``Range: bytes=a-b``) is answered here from the
requested bytes only, read from moto's own object buffer, and everything else goes to moto.
Both modes can be measured against the same objects by flipping the flag between runs.

Stock moto's ``CompleteMultipartUpload`` also reads every part twice and copies the object
about five times in memory (≈5× the object in RSS, ~80 MB/s here), where S3 completes from
part metadata. With ``lean_complete`` on, :func:`lean_complete` replaces moto's
``FakeMultipart.complete`` while the server runs: same validation, ETag and checksum, one
buffer of the object's size: a 1 GiB object peaks at ~2.5× its size in the server (with the
parts in flight), not ~5×.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from unittest import mock
from urllib.parse import parse_qs

from dcp_fsspec.local_s3 import LocalS3Server

COUNTERS_PATH = "/__bench__/counters"
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CONDITIONS = (
    "HTTP_IF_NONE_MATCH",
    "HTTP_IF_MODIFIED_SINCE",
    "HTTP_IF_UNMODIFIED_SINCE",
)

StartResponse = Callable[..., Any]


def operation(environ: dict[str, Any]) -> str:
    """The S3 operation a path-style request is, by method, path depth and query."""
    method = environ["REQUEST_METHOD"]
    query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    parts = environ.get("PATH_INFO", "/").lstrip("/").split("/", 1)
    has_key = len(parts) == 2 and parts[1] != ""
    if not has_key:
        if method == "POST" and "delete" in query:
            return "DeleteObjects"
        return {"GET": "ListObjects", "HEAD": "HeadBucket", "PUT": "CreateBucket"}.get(
            method, f"{method} bucket"
        )
    if method == "PUT":
        if "partNumber" in query:
            return "UploadPart"
        return "CopyObject" if environ.get("HTTP_X_AMZ_COPY_SOURCE") else "PutObject"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        return "CompleteMultipartUpload" if "uploadId" in query else "POST object"
    if method == "GET":
        if "uploadId" in query:
            return "ListParts"
        return "GetObject(range)" if environ.get("HTTP_RANGE") else "GetObject"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    return {"HEAD": "HeadObject"}.get(method, f"{method} object")


class _CountingInput:
    """``wsgi.input`` that counts what the application reads from it."""

    def __init__(self, stream: Any, count: Callable[[int], None]) -> None:
        self._stream = stream
        self._count = count

    def read(self, *args: Any) -> bytes:
        data = self._stream.read(*args)
        self._count(len(data))
        return data

    def readline(self, *args: Any) -> bytes:
        data = self._stream.readline(*args)
        self._count(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        n = self._stream.readinto(buf)
        self._count(n or 0)
        return n

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.readline, b"")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class CountingApp:
    """WSGI middleware around moto: counters per operation, and the fast range path."""

    # Stock moto reads the whole object into memory for every GET, before it answers; this
    # many may do so at once, so that clients splitting a read into many concurrent ranged
    # GETs (s3torchconnector's CRT client) cannot hold one object copy per connection. The
    # work is under the GIL either way.
    WHOLE_OBJECT_GETS = 2

    def __init__(self, app: Callable[..., Iterable[bytes]], fast_ranges: bool = True) -> None:
        self.app = app
        self.fast_ranges = fast_ranges
        self._lock = threading.Lock()
        self._ops: dict[str, dict[str, float]] = {}
        self._whole_object_gets = threading.BoundedSemaphore(self.WHOLE_OBJECT_GETS)

    def counters(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {op: dict(c) for op, c in self._ops.items()}

    def _add(self, op: str, field: str, value: float) -> None:
        with self._lock:
            c = self._ops.setdefault(op, {"requests": 0, "bytes_in": 0, "bytes_out": 0, "seconds": 0.0})
            c[field] += value

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == COUNTERS_PATH:
            doc = json.dumps({"fast_ranges": self.fast_ranges, "operations": self.counters()})
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(doc)))]
            )
            return [doc.encode()]
        op = operation(environ)
        started = time.perf_counter()
        self._add(op, "requests", 1)
        environ["wsgi.input"] = _CountingInput(environ["wsgi.input"], lambda n: self._add(op, "bytes_in", n))
        ranged = self._serve_range(environ, start_response) if self.fast_ranges else None
        if ranged is not None:
            body: Iterable[bytes] = ranged
        elif op.startswith("GetObject"):
            # moto builds the whole answer inside this call; the body left is the bytes to send.
            with self._whole_object_gets:
                body = self.app(environ, start_response)
        else:
            body = self.app(environ, start_response)
        return self._count_out(op, started, body)

    def _count_out(self, op: str, started: float, body: Iterable[bytes]) -> Iterator[bytes]:
        try:
            for chunk in body:
                self._add(op, "bytes_out", len(chunk))
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
            self._add(op, "seconds", time.perf_counter() - started)

    def _serve_range(self, environ: dict[str, Any], start_response: StartResponse) -> list[bytes] | None:
        """Answer ``GET /bucket/key`` with ``Range: bytes=a-b`` from those bytes alone, or
        return ``None`` to leave the request to moto (errors, conditions, versions, suffix
        and multi-ranges all take moto's path, so their answers stay moto's)."""
        if environ["REQUEST_METHOD"] != "GET":
            return None
        match = _RANGE.match(environ.get("HTTP_RANGE", ""))
        if match is None or any(environ.get(h) for h in _CONDITIONS):
            return None
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        if set(query) - {"x-id"}:
            return None
        parts = environ.get("PATH_INFO", "").lstrip("/").split("/", 1)
        if len(parts) != 2 or not parts[1]:
            return None
        key = _find_key(*parts)
        if key is None:
            return None
        begin = int(match.group(1))
        end = int(match.group(2)) if match.group(2) else key.size - 1
        if begin > end or begin >= key.size:
            return None
        end = min(end, key.size - 1)
        # moto keeps each object in a SpooledTemporaryFile guarded by ``key.lock``; reading
        # the range from it is what a real object store does, instead of ``key.value``
        # (which copies the whole object).
        with key.lock:
            etag = key.etag
            if_match = environ.get("HTTP_IF_MATCH")
            if if_match and if_match.strip('"') != etag.strip('"'):
                return None
            key._value_buffer.seek(begin)
            data = key._value_buffer.read(end - begin + 1)
        headers = [
            ("ETag", etag),
            ("Last-Modified", key.last_modified_RFC1123),
            ("Content-Type", key.metadata.get("Content-Type", "binary/octet-stream")),
            ("Accept-Ranges", "bytes"),
            ("Content-Range", f"bytes {begin}-{end}/{key.size}"),
            ("Content-Length", str(len(data))),
        ]
        start_response("206 Partial Content", headers)
        return [data]


def lean_complete(
    self: Any, body: Iterator[tuple[int, str]]
) -> tuple[bytearray, str, tuple[str, str, int] | None]:
    """``moto.s3.models.FakeMultipart.complete`` (moto 5.x) reading each part once into one
    preallocated buffer; the checks, the ETag (MD5 of the part MD5s, ``-N``) and the checksum
    are moto's."""
    from moto.s3.exceptions import EntityTooSmall, InvalidPart, MalformedXML
    from moto.s3.models import MultipartChecksumBuilder
    from moto.s3.utils import compute_checksum
    from moto.settings import S3_UPLOAD_PART_MIN_SIZE
    from moto.utilities.utils import md5_hash

    checksums = MultipartChecksumBuilder(
        self.metadata.get("x-amz-checksum-algorithm"), self.metadata.get("x-amz-checksum-type")
    )
    parts: list[Any] = []
    for number, etag in body:
        part = self.parts.get(number)
        if part is None or part.etag.strip('"') != etag.strip('"'):
            raise InvalidPart()
        if parts and parts[-1].contentsize < S3_UPLOAD_PART_MIN_SIZE:
            raise EntityTooSmall()
        parts.append(part)
    if not parts:
        raise MalformedXML
    whole = bytearray(sum(p.contentsize for p in parts))
    view = memoryview(whole)
    pos = 0
    for part in parts:
        with part.lock:
            part._value_buffer.seek(0)
            chunk = view[pos : pos + part.contentsize]
            part._value_buffer.readinto(chunk)
        if checksums.checksum_type == "COMPOSITE":
            checksums.addPart(bytes(chunk))
        pos += part.contentsize
    if checksums.checksum_type == "COMPOSITE":
        checksum = checksums.build()
    else:  # FULL_OBJECT: moto's builder would first copy the whole object once more
        algorithm = checksums.checksum_algorithm
        checksum = (checksums.checksum_type, compute_checksum(bytes(whole), algorithm).decode(), 1)
    md5s = b"".join(bytes.fromhex(p.etag.strip('"')) for p in parts)
    full_etag = md5_hash()
    full_etag.update(md5s)
    return whole, f"{full_etag.hexdigest()}-{len(parts)}", checksum


def _find_key(bucket_name: str, key_name: str) -> Any:
    from moto.s3.models import s3_backends

    located = s3_backends.bucket_accounts.get(bucket_name)
    if located is None:
        return None
    partition, account_id = located
    bucket = s3_backends[account_id][partition].buckets.get(bucket_name)
    if bucket is None or key_name not in bucket.keys:
        return None
    key = bucket.keys[key_name]
    # A delete marker or any other non-object answers through moto.
    return key if hasattr(key, "_value_buffer") else None


class CountingS3Server(LocalS3Server):
    """:class:`~dcp_fsspec.local_s3.LocalS3Server` with :class:`CountingApp` in front of
    moto; same credentials, ``storage_options()`` and ``environ()``."""

    def __init__(self, fast_ranges: bool = True, lean_complete: bool = True) -> None:
        super().__init__()
        self.app: CountingApp | None = None
        self._fast_ranges = fast_ranges
        self._lean_complete = lean_complete
        self._patch: Any = None
        self._httpd: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> CountingS3Server:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        class QuietHandler(MotoRequestHandler):
            def log_request(self, *args: Any) -> None:  # one line per request drowns the output
                pass

        if self._lean_complete:
            from moto.s3.models import FakeMultipart

            self._patch = mock.patch.object(FakeMultipart, "complete", lean_complete)
            self._patch.start()
        self.app = CountingApp(DomainDispatcherApplication(create_backend_app), self._fast_ranges)
        self._httpd = make_server("127.0.0.1", 0, self.app, threaded=True, request_handler=QuietHandler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        host, port = self._httpd.server_address[:2]
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._patch is not None:
            self._patch.stop()
            self._patch = None

    @property
    def counters_url(self) -> str:
        return self.endpoint_url + COUNTERS_PATH


def fetch_counters(url: str) -> dict[str, dict[str, float]]:
    """The server's counters as a worker process sees them."""
    from urllib.request import urlopen

    with urlopen(url, timeout=30) as r:
        return json.loads(r.read())["operations"]


def delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Counters of what happened between two snapshots, operations with no requests dropped."""
    out = {}
    for op, c in after.items():
        b = before.get(op, {})
        d = {f: v - b.get(f, 0) for f, v in c.items()}
        if d["requests"] or d["bytes_in"] or d["bytes_out"]:
            out[op] = d
    return out


def totals(ops: dict[str, dict[str, float]]) -> dict[str, float]:
    keys = ("requests", "bytes_in", "bytes_out", "seconds")
    return {k: sum(c.get(k, 0) for c in ops.values()) for k in keys}
