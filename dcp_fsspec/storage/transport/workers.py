"""Threads kept between loads (and a local save's fsyncs, :mod:`~dcp_fsspec.storage.transport.file_syncs`): a small load
takes a few milliseconds, and starting its threads anew each time was a large part of them
(three pools per key).

A :class:`Workers` is one read's share of a process-wide pool: what it submits runs on the
pool's threads, and :meth:`Workers.close` cancels what has not started and waits for what has —
as ``ThreadPoolExecutor.shutdown(wait=True, cancel_futures=True)`` does for a pool of one's own —
so no task of a failed read still writes into a tensor after the read has returned. The pools
are per role (a task never waits for a task of its own role's pool: reads wait for nothing,
checksums wait for reads) and per size, and a forked child makes its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_pools_pid: int | None = None


class Workers:
    """Tasks of one read on the shared ``role`` pool of ``threads`` threads, closed together.

    Args:
        role: what the tasks do (``"read"``, ``"crc"``); it names the threads
            (``dcp-fsspec-{role}``). Tasks of one role must not wait for each other.
        threads: the pool's size: at most this many of the role's tasks run at once, across
            every read that uses the same role and size at the same time. ``0``: no thread at
            all; each task runs on the caller's thread as it is submitted (work too small for a
            hand-off to pay), its result or error in the future returned.
    """

    def __init__(self, role: str, threads: int) -> None:
        self._pool = _shared_pool(role, threads) if threads > 0 else None
        # The tasks not yet done; a done one leaves, so its result (a span's bytes) is freed as
        # soon as its caller lets go of it, however many tasks a long read submits.
        self._pending: set[Future[Any]] = set()
        self._pending_lock = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._pool is None:
            return _run_here(fn, *args, **kwargs)
        future = self._pool.submit(fn, *args, **kwargs)
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future[Any]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def close(self) -> None:
        """Cancel the tasks that have not started; wait for the others (their errors are the
        caller's to have seen through their futures)."""
        with self._pending_lock:
            futures = list(self._pending)
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                future.exception()  # waits; what it raised is the future's owner's to report

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_here(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
    future: Future[T] = Future()
    try:
        future.set_result(fn(*args, **kwargs))
    except Exception as e:  # the caller sees it through the future, as from a pool
        future.set_exception(e)
    return future


def _shared_pool(role: str, threads: int) -> ThreadPoolExecutor:
    global _pools_pid
    with _lock:
        if _pools_pid != os.getpid():  # a forked child: the parent's threads are not here
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.get((role, threads))
        if pool is None:
            pool = _pools[(role, threads)] = ThreadPoolExecutor(
                threads, thread_name_prefix=f"dcp-fsspec-{role}"
            )
        return pool
