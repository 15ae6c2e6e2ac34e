"""A proxy in front of moto that throttles as S3 does: a token bucket per key prefix.

Tests and benchmarks put one between the clients and moto, with a request rate well below
what a save or a load asks for. A request over the rate gets S3's own answer, ``503 SlowDown``,
and never reaches moto. The proxy counts what it admitted and what it refused.

    proxy = ThrottlingProxy(s3_server.endpoint_url, rate=50, burst=10).start()
    options["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
    ...
    proxy.refused, proxy.admitted
    proxy.stop()
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from tests.servers.proxy import _CHUNK, LoopbackProxy


def prefix_of(target: str) -> str:
    """The prefix S3 rates a request against: its path up to the last ``/`` (``/bucket/a/b/``)."""
    path = unquote(urlsplit(target).path)
    return path[: path.rfind("/") + 1]


def bucket_of(target: str) -> str:
    """The bucket a request names (``/bucket/``): a new bucket's one prefix, before S3 splits it."""
    path = unquote(urlsplit(target).path)
    return "/" + path.lstrip("/").split("/", 1)[0] + "/"


def slow_down(method: str) -> bytes:
    """S3's whole answer to a request over the rate: ``503 Slow Down`` with its XML error."""
    request_id = uuid.uuid4().hex[:16].upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
        f"<RequestId>{request_id}</RequestId><HostId>{uuid.uuid4().hex}</HostId></Error>"
    ).encode()
    if method == "HEAD":  # a HEAD's answer has headers only
        body = b""
    head = (
        "HTTP/1.1 503 Slow Down\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}\r\n"
        "Server: AmazonS3\r\n"
        "\r\n"
    )
    return head.encode() + body


@dataclass
class _Bucket:
    """Tokens of one prefix: ``burst`` at most, refilled at the proxy's rate."""

    tokens: float
    at: float = field(default_factory=time.monotonic)


class ThrottlingProxy(LoopbackProxy):
    """Forwards to ``upstream`` (moto) the requests each prefix's token bucket admits; answers
    the others ``503 SlowDown`` itself.

    Args:
        upstream: the server's URL (``http://host:port``).
        rate: requests per second each prefix is allowed, on average.
        burst: requests a prefix may send at once after a quiet spell (the bucket's size).
        per_bucket: rate a whole bucket as one prefix, as S3 does a new bucket until it has
            split it by load (a thousand ranks' files under many folders share its rate).

    ``admitted`` and ``refused`` count requests, over every prefix; ``admitted_by_prefix`` and
    ``refused_by_prefix`` say where. :meth:`set_rate` changes the limits while clients run (``rate=None``: no limit).
    """

    def __init__(
        self, upstream: str, *, rate: float | None, burst: int = 1, per_bucket: bool = False
    ) -> None:
        super().__init__(upstream)
        self._prefix_of = bucket_of if per_bucket else prefix_of
        self.rate = rate
        self.burst = max(0, burst)
        self._buckets: dict[str, _Bucket] = {}
        self.admitted = 0
        self.refused = 0
        self.admitted_by_prefix: defaultdict[str, int] = defaultdict(int)
        self.refused_by_prefix: defaultdict[str, int] = defaultdict(int)

    def set_rate(self, rate: float | None, burst: int | None = None) -> None:
        """New limits, from now on (``rate=None`` admits everything: throttling clears)."""
        self._loop.call_soon_threadsafe(self._set_rate, rate, burst)

    def _set_rate(self, rate: float | None, burst: int | None) -> None:
        self.rate = rate
        self.burst = max(0, self.burst if burst is None else burst)
        self._buckets.clear()

    def reset(self) -> None:
        """Start counting from zero."""
        self.admitted = self.refused = 0
        self.admitted_by_prefix.clear()
        self.refused_by_prefix.clear()

    def _admit(self, prefix: str) -> bool:
        """Take one of ``prefix``'s tokens if it has one (runs on the proxy's loop only)."""
        if self.rate is None:
            return True
        now = time.monotonic()
        bucket = self._buckets.setdefault(prefix, _Bucket(float(self.burst), now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens < 1:
            return False
        bucket.tokens -= 1
        return True

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_w.close()
            return
        responses = asyncio.ensure_future(self._pipe(server_r, client_w))
        try:
            while await self._request(client_r, client_w, server_w):
                pass
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # the client went away, or sent what is not HTTP: end the connection
        except asyncio.CancelledError:
            pass  # stop()
        finally:
            server_w.close()
            responses.cancel()
            client_w.close()

    async def _request(
        self, reader: asyncio.StreamReader, client_w: asyncio.StreamWriter, server_w: asyncio.StreamWriter
    ) -> bool:
        """Forward or refuse the client's next request; False once the connection is to end.

        Clients send one request at a time on a connection and wait for its answer, so an
        answer of the proxy's own never interleaves with one of the server's.
        """
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        method, target, headers = _parse_head(head)
        prefix = self._prefix_of(target)
        if self._admit(prefix):
            self.admitted += 1
            self.admitted_by_prefix[prefix] += 1
            server_w.write(head)
            await _copy_body(reader, headers, server_w)
            return True
        self.refused += 1
        self.refused_by_prefix[prefix] += 1
        if headers.get("expect", "").lower() == "100-continue":
            # The client waits for a go-ahead before its body: refuse it, and end the connection
            # (as S3 may), since the body will not follow.
            client_w.write(slow_down(method).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
            await client_w.drain()
            return False
        await _copy_body(reader, headers, None)
        client_w.write(slow_down(method))
        await client_w.drain()
        return True


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """A request head's method, target and headers (names in lower case)."""
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return method, target, headers


async def _copy_body(
    reader: asyncio.StreamReader, headers: dict[str, str], writer: asyncio.StreamWriter | None
) -> None:
    """Pass a request's body on to ``writer`` (``None``: read and drop it), as it is framed."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            await _send(size_line, writer)
            if size == 0:  # the last chunk: trailers up to an empty line
                while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                    await _send(line, writer)
                await _send(line, writer)
                return
            await _copy(reader, size + 2, writer)
    await _copy(reader, int(headers.get("content-length", "0")), writer)


async def _send(data: bytes, writer: asyncio.StreamWriter | None) -> None:
    if writer is not None:
        writer.write(data)
        await writer.drain()


async def _copy(reader: asyncio.StreamReader, n: int, writer: asyncio.StreamWriter | None) -> None:
    """``n`` bytes of ``reader`` to ``writer``, as they come."""
    while n > 0:
        chunk = await reader.read(min(n, _CHUNK))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(chunk)
        if writer is not None:
            writer.write(chunk)
            await writer.drain()
