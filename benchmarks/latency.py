"""A TCP proxy on 127.0.0.1 that delays every byte by a fixed one-way latency.

An S3 server on loopback answers in well under a millisecond, so a benchmark against it cannot
show what a request one after another costs across a network (a few ms to an object store in
the same region). ``LatencyProxy(upstream, rtt_ms=10)`` sits in front of the server: each chunk
read from either side is forwarded ``rtt_ms / 2`` after it arrived, in order and pipelined, so
a request and its answer take one round trip more and bandwidth is not limited. Used by
``benchmarks.small --rtt-ms``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from urllib.parse import urlsplit

_CHUNK = 1 << 16


class LatencyProxy:
    """Forwards connections to ``upstream`` (``http://host:port``), ``rtt_ms`` per round trip."""

    def __init__(self, upstream: str, rtt_ms: float) -> None:
        parts = urlsplit(upstream)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self._upstream = (parts.hostname, parts.port)
        self._delay = rtt_ms / 2000.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="latency-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self.endpoint_url = ""

    def start(self) -> LatencyProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, "127.0.0.1", 0), self._loop
        ).result()
        host, port = self._server.sockets[0].getsockname()[:2]
        self.endpoint_url = f"http://{host}:{port}"
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
            await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w), return_exceptions=True)
        except (asyncio.CancelledError, OSError):  # stop(), or the server went away: end quietly
            client_w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward ``reader`` to ``writer``, each chunk ``self._delay`` after it arrived."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            while chunk := await reader.read(_CHUNK):
                queue.put_nowait((time.monotonic() + self._delay, chunk))
            queue.put_nowait((time.monotonic() + self._delay, b""))

        reading = asyncio.ensure_future(read())
        try:
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if not chunk:
                    break
                writer.write(chunk)
                await writer.drain()
        finally:
            reading.cancel()
            writer.close()
