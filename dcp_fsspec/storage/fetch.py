"""Reading byte ranges of files concurrently, with a bounded amount of data in memory.

The reader plans its loads as a list of :class:`Span` (file, start, end), sorted by file and
offset and already coalesced. :func:`fetch_in_order` downloads them concurrently — on fsspec's
event loop for async filesystems (s3fs, gcsfs, adlfs), on a thread pool otherwise — and yields
their bytes *in plan order*, never holding more than ``window_bytes`` of downloaded or
downloading data. Yielding in order is what lets the decoder stream a record's header before its
data and copy each piece straight into its tensor. Each read is retried by the load's
:class:`~.retry.RetryPolicy` (throttling, 5xx, dropped connections) within its deadline.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .retry import NO_RETRY, RetryPolicy

# Backends whose cat_file(path, start, end) returns the whole file rather than the range.
_NO_RANGED_CAT = {"sftp", "ssh"}


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, end)`` of ``path``."""

    path: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def plan_spans(
    ranges: list[tuple[str, int, int]], *, max_gap: int, max_span: int
) -> list[Span]:
    """Sort ranges by file and offset, merge neighbours closer than ``max_gap``, cut at ``max_span``.

    Merging saves requests for the many small records of a checkpoint; the gap bound keeps the
    extra bytes downloaded small; cutting large spans lets one big tensor download over several
    connections at once.
    """
    spans: list[Span] = []
    current: list[Any] | None = None
    for path, start, end in sorted(ranges):
        if current is not None and path == current[0] and start - current[2] <= max_gap:
            current[2] = max(current[2], end)
            continue
        if current is not None:
            spans.extend(_cut(Span(*current), max_span))
        current = [path, start, end]
    if current is not None:
        spans.extend(_cut(Span(*current), max_span))
    return spans


def _cut(span: Span, max_span: int) -> list[Span]:
    return [Span(span.path, s, min(s + max_span, span.end)) for s in range(span.start, span.end, max_span)] or [span]


class LocalFiles:
    """Local files opened once each, for positional reads from several threads at once."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def read(self, path: str, size: int, offset: int) -> bytes:
        return os.pread(self._fd(path), size, offset)

    def read_into(self, path: str, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``path`` at ``offset``: the bytes read, fewer only at the end of the file."""
        fd = self._fd(path)
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if not n:
                break
            got += n
        return got

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class _Fetcher:
    """Starts one span's download and returns a future of its bytes."""

    def __init__(self, fs: fsspec.AbstractFileSystem, threads: int, retry: RetryPolicy) -> None:
        self.fs = fs
        self.retry = retry
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self._ranged_cat = protocol not in _NO_RANGED_CAT
        # sshfs is async too, but its _cat_file ignores start/end: it reads through open/seek/read
        # on the thread pool instead.
        self._async = (
            self._ranged_cat and bool(getattr(fs, "async_impl", False)) and getattr(fs, "loop", None) is not None
        )
        # s3fs: ranged GETs are read into one buffer as the body arrives (its _cat_file keeps the
        # body's chunks and joins them at the end: each span twice in memory at that moment).
        self._s3 = self._async and callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None))
        self._pool = None if self._async else ThreadPoolExecutor(threads, thread_name_prefix="dcp-fsspec-read")
        self._local = LocalFiles() if isinstance(fs, LocalFileSystem) else None

    def start(self, span: Span) -> Future[bytes | bytearray]:
        url = self.fs.unstrip_protocol(span.path)
        if self._async:
            read = (
                (lambda: self._s3_range(span))
                if self._s3
                else (lambda: self.fs._cat_file(span.path, start=span.start, end=span.end))
            )
            return asyncio.run_coroutine_threadsafe(self.retry.call_async(read, url=url), self.fs.loop)
        assert self._pool is not None
        return self._pool.submit(self.retry.call, lambda: self._read_sync(span), url=url)

    async def _s3_range(self, span: Span) -> bytes | bytearray:
        bucket, key, version = self.fs.split_path(span.path)
        response = await self.fs._call_s3(
            "get_object",
            Bucket=bucket,
            Key=key,
            Range=f"bytes={span.start}-{span.end - 1}",
            **({"VersionId": version} if version else {}),
        )
        body = response["Body"]
        out = bytearray(span.size)
        view = memoryview(out)
        got = 0
        try:
            while got < span.size:
                n = await body.readinto(view[got:])
                if not n:  # the object ends before the span does: the caller reports it truncated
                    return bytes(view[:got])
                got += n
        finally:
            body.close()
        return out

    def _read_sync(self, span: Span) -> bytes:
        if self._local is not None:
            return self._local.read(span.path, span.size, span.start)
        if self._ranged_cat:
            return bytes(self.fs.cat_file(span.path, start=span.start, end=span.end))
        # Not block_size=0: sshfs would then read with one unpipelined request, which the
        # server answers with at most its packet limit.
        with self.fs.open(span.path, "rb") as f:
            f.seek(span.start)
            return f.read(span.size)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._local is not None:
            self._local.close()


def fetch_in_order(
    fs: fsspec.AbstractFileSystem,
    spans: list[Span],
    *,
    window_bytes: int,
    threads: int = 16,
    retry: RetryPolicy = NO_RETRY,
) -> Iterator[tuple[Span, bytes | bytearray]]:
    """Yield ``(span, data)`` for every span, in order, downloading ahead within ``window_bytes``.

    Raises whatever the backend raised for the first span that failed; downloads still in flight
    are cancelled (or drained) before this returns.
    """
    fetcher = _Fetcher(fs, threads, retry)
    inflight: deque[tuple[Span, Future[bytes | bytearray]]] = deque()
    inflight_bytes = 0
    queue = iter(spans)
    pending: Span | None = next(queue, None)
    try:
        while pending is not None or inflight:
            # Keep the window full; always allow one span so a span larger than it still moves.
            while pending is not None and (not inflight or inflight_bytes + pending.size <= window_bytes):
                inflight.append((pending, fetcher.start(pending)))
                inflight_bytes += pending.size
                pending = next(queue, None)
            span, future = inflight.popleft()
            data = future.result()
            inflight_bytes -= span.size
            yield span, data
    finally:
        for _, future in inflight:
            future.cancel()
        for _, future in inflight:
            if not future.cancelled():
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - already failing or closing; nothing to add
                    pass
        fetcher.close()
