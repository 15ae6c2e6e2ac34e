"""A fault-injecting HTTP proxy on loopback, in front of the moto S3 server the tests start.

:class:`FaultyProxy` listens on 127.0.0.1 (port chosen by the OS) and forwards every request to
an upstream endpoint, except that a seeded fraction of requests fail the way object stores and
networks fail:

* ``"503"``: ``503 SlowDown`` (throttling), the request is not forwarded;
* ``"500"``: ``500 InternalError``, not forwarded;
* ``"drop"``: the connection is reset before the request is forwarded;
* ``"cut"``: the request *is* forwarded (the server applies it), then the connection is reset
  part-way through the response, so the client cannot tell whether it happened.

``deny`` makes it answer ``403 InvalidAccessKeyId`` to everything (bad credentials), which a
client must not retry. ``match`` limits faults to some requests (say, only part uploads) and
``max_faults`` to a number of them. Counters (:attr:`FaultyProxy.requests`,
:attr:`FaultyProxy.faults`) and :attr:`FaultyProxy.log` let tests assert what was attempted.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

FAULT_KINDS = ("503", "500", "drop", "cut")
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}
_ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "403": (403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records."),
}


class FaultyProxy:
    """Forward HTTP to ``upstream``, failing a fraction ``rate`` of requests (seeded).

    Args:
        upstream: the real endpoint, e.g. ``http://127.0.0.1:5000``.
        rate: the probability that a request fails, 0 to 1.
        seed: seeds the sequence of decisions (which requests fail, and how).
        kinds: the ways requests fail, drawn uniformly.
    """

    def __init__(
        self, upstream: str, *, rate: float = 0.0, seed: int = 0, kinds: tuple[str, ...] = FAULT_KINDS
    ) -> None:
        target = urlsplit(upstream)
        self._upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.rate = rate
        self.kinds = kinds
        self.deny = False
        # Only requests for which match(method, path) is true may fail; at most max_faults of them.
        self.match: Callable[[str, str], bool] | None = None
        self.max_faults: int | None = None
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, fault)
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by HTTP method
        self.faults: Counter[str] = Counter()  # by kind
        self._server: ThreadingHTTPServer | None = None
        self._connections: set[socket.socket] = set()
        self.endpoint_url = ""

    def start(self) -> FaultyProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="faulty-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for conn in list(self._connections):
                _reset(conn)
        self._server = None

    def __enter__(self) -> FaultyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextmanager
    def faults_at(self, rate: float, kinds: tuple[str, ...] | None = None) -> Iterator[FaultyProxy]:
        """Change the fault rate (and kinds) for the duration of a ``with`` block."""
        saved = (self.rate, self.kinds)
        self.rate, self.kinds = rate, kinds or self.kinds
        try:
            yield self
        finally:
            self.rate, self.kinds = saved

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests[method] += 1
            eligible = (self.match is None or self.match(method, path)) and (
                self.max_faults is None or sum(self.faults.values()) < self.max_faults
            )
            fault: str | None = None
            if self.deny:
                fault = "403"
            elif eligible and self.rate and self._random.random() < self.rate:
                fault = self._random.choice(self.kinds)
            if fault is not None:
                self.faults[fault] += 1
            self.log.append((method, path, fault))
            return fault

    def _forward(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self._upstream, timeout=600)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.reason, resp.getheaders(), payload
        finally:
            conn.close()


class _Handler(BaseHTTPRequestHandler):
    owner: FaultyProxy
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._connections.add(self.connection)

    def finish(self) -> None:
        with self.owner._lock:
            self.owner._connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass  # the socket was reset on purpose

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:
        self._proxy()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _proxy(self) -> None:
        body = self._read_body()
        fault = self.owner._decide(self.command, self.path)
        if fault in _ERRORS:
            self._send_error(*_ERRORS[fault])
            return
        if fault == "drop":
            self._drop()
            return
        status, reason, headers, payload = self.owner._forward(
            self.command, self.path, list(self.headers.items()), body
        )
        head_only = self.command == "HEAD"  # keeps the upstream's Content-Length, sends no body
        out = [
            (n, v)
            for n, v in headers
            if n.lower() not in _HOP_BY_HOP and (head_only or n.lower() != "content-length")
        ]
        if not head_only:
            out.append(("Content-Length", str(len(payload))))
        head = (f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in out) + "\r\n").encode(
            "latin-1"
        )
        response = head + (b"" if head_only else payload)
        if fault == "cut":
            # Applied upstream, but the client sees the connection die mid-response.
            self.wfile.write(
                response[: len(head) + len(payload) // 2 if payload and not head_only else len(head) // 2]
            )
            self._drop()
            return
        self.wfile.write(response)

    def _send_error(self, status: int, code: str, message: str) -> None:
        xml = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>faulty-proxy</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.wfile.flush()
        except OSError:
            pass
        _reset(self.connection)


def _reset(conn: socket.socket) -> None:
    """Close ``conn`` with a TCP reset (as a crashed server or a middlebox does), not a clean FIN."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
