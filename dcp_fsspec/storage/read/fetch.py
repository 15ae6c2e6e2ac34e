"""Reading byte ranges of files concurrently, with a bounded amount of data in memory.

The reader plans its loads as a list of :class:`Span` (file, start, end), sorted by file and
offset and already coalesced. :func:`fetch_in_order` downloads them concurrently — on fsspec's
event loop where the backend reads asynchronously (s3fs, gcsfs, adlfs), on a thread pool otherwise,
each read the backend's way (:mod:`~dcp_fsspec.storage.backends`) — and yields
their bytes *in plan order*, never holding more than ``window_bytes`` of downloaded or
downloading data. Yielding in order is what lets the decoder stream a record's header before its
data and copy each piece straight into its tensor. Each read is retried by the load's
:class:`~dcp_fsspec.storage.transport.retry.RetryPolicy` (throttling, 5xx, dropped connections) within its deadline.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import fsspec

from dcp_fsspec.storage.backends import backend_for
from dcp_fsspec.storage.transport.concurrency import store_limit
from dcp_fsspec.storage.transport.retry import NO_RETRY, RetryPolicy
from dcp_fsspec.storage.transport.workers import Workers


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, end)`` of ``path``."""

    path: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def plan_spans(ranges: list[tuple[str, int, int]], *, max_gap: int, max_span: int) -> list[Span]:
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
    return [
        Span(span.path, s, min(s + max_span, span.end)) for s in range(span.start, span.end, max_span)
    ] or [span]


class _Fetcher:
    """Starts one span's download and returns a future of its bytes, the way the backend reads."""

    def __init__(self, fs: fsspec.AbstractFileSystem, threads: int, retry: RetryPolicy) -> None:
        self.fs = fs
        self.retry = retry
        self.backend = backend_for(fs, retry)
        self._async = self.backend.async_reads
        # Reads at once to the store, lowered while it throttles (shared with its uploads).
        self._limit = store_limit(fs) if self._async else None
        self._reader = None if self._async else self.backend.range_reader()
        self._pool = None if self._async else Workers("fetch", threads)

    def start(self, span: Span) -> Future[bytes | bytearray]:
        url = self.backend.url_of(span.path)
        if self._async:
            read = lambda: self.backend.read_range_async(span.path, span.start, span.end)  # noqa: E731
            reading = self.retry.call_async(read, url=url, kind="GET", limit=self._limit)
            return asyncio.run_coroutine_threadsafe(reading, self.fs.loop)
        assert self._pool is not None and self._reader is not None
        reader = self._reader
        return self._pool.submit(
            self.retry.call, lambda: reader.read(span.path, span.size, span.start), url=url
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._reader is not None:
            self._reader.close()


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
