"""A proxy in front of an HTTP server that counts what passes, and can cut every connection.

Multi-rank tests and benchmarks put one in front of moto to count the bytes the server sends
(what a store bills as egress) and the GET requests, or to drop a rank's connections mid-load.
"""

from __future__ import annotations

import asyncio

from tests.servers.proxy import _CHUNK, LoopbackProxy


class CountingProxy(LoopbackProxy):
    """Forwards to ``upstream``, counting bytes sent to clients, bytes received from them
    (request heads and bodies: what a save uploads), GET requests and listings among them.

    Args:
        upstream: the server's URL (``http://host:port``).
        cut_after: once the server has sent this many bytes through the proxy, close every
            connection mid-transfer and refuse new ones; ``None``: never.
    """

    def __init__(self, upstream: str, *, cut_after: int | None = None) -> None:
        super().__init__(upstream)
        self.cut_after = cut_after
        self.sent = 0
        self.received = 0
        self.gets = 0
        self.lists = 0
        self.cut = False

    def reset(self) -> None:
        """Start counting from zero."""
        self.sent = self.received = self.gets = self.lists = 0

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.cut:
            client_w.close()
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self._upstream)
            await asyncio.gather(
                self._requests(client_r, server_w),
                self._responses(server_r, client_w, server_w),
                return_exceptions=True,
            )
        except (asyncio.CancelledError, OSError):
            client_w.close()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(_CHUNK):
                # A request line starts a chunk: botocore writes each request's head in one go.
                self.gets += chunk.startswith(b"GET ")
                self.lists += chunk.startswith(b"GET ") and b"list-type=" in chunk.split(b"\r\n", 1)[0]
                self.received += len(chunk)
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.close()

    async def _responses(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: asyncio.StreamWriter
    ) -> None:
        try:
            while chunk := await reader.read(_CHUNK):
                if self.cut_after is not None and self.sent + len(chunk) > self.cut_after:
                    self.cut = True
                if self.cut:
                    writer.write(chunk[: len(chunk) // 2])
                    writer.transport.abort()
                    upstream.transport.abort()
                    return
                self.sent += len(chunk)
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.close()
