"""A TCP proxy on 127.0.0.1 in front of a plain-HTTP server, on an event loop of its own.

The base of :class:`~tests.servers.tls.TlsFront` (TLS in front of moto) and of
``benchmarks.latency.LatencyProxy`` (a network's round trip in front of it): each connection
it accepts is paired with one to ``upstream``, and :meth:`LoopbackProxy._pipe` carries the bytes
each way (a subclass changes how).
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from urllib.parse import urlsplit

_CHUNK = 1 << 16


class LoopbackProxy:
    """Forwards connections on 127.0.0.1 to ``upstream`` (``http://host:port``).

    Args:
        upstream: the server's URL.
        tls: a server-side context: clients then speak TLS to the proxy (``https://``).
    """

    def __init__(self, upstream: str, *, tls: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self._upstream = (parts.hostname, parts.port)
        self._tls = tls
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=type(self).__name__, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self.endpoint_url = ""

    def start(self) -> LoopbackProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, "127.0.0.1", 0, ssl=self._tls), self._loop
        ).result()
        host, port = self._server.sockets[0].getsockname()[:2]
        self.endpoint_url = f"{'https' if self._tls else 'http'}://{host}:{port}"
        return self

    def stop(self) -> None:
        """Close the listener and every connection, then the loop."""
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self._upstream)
            await asyncio.gather(
                self._pipe(client_r, server_w), self._pipe(server_r, client_w), return_exceptions=True
            )
        except (asyncio.CancelledError, OSError):  # stop(), or the server went away: end quietly
            client_w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward ``reader`` to ``writer`` as the bytes come."""
        try:
            while chunk := await reader.read(_CHUNK):
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.close()
