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
import time

from tests.servers.proxy import LoopbackProxy

_CHUNK = 1 << 16


class LatencyProxy(LoopbackProxy):
    """Forwards connections to ``upstream`` (``http://host:port``), ``rtt_ms`` per round trip."""

    def __init__(self, upstream: str, rtt_ms: float) -> None:
        super().__init__(upstream)
        self._delay = rtt_ms / 2000.0

    def start(self) -> LatencyProxy:
        super().start()
        return self

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
