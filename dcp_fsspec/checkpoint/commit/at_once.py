"""Independent calls sent together: a small save's or load's time is its round trips, not its bytes.

A save of a small state on S3 is a handful of requests that need not wait for each other (the
pointer, the iteration's commit record and listing, each key's ``.metadata``, each key's files):
sent together, they cost one round trip instead of one each.

The calls run on one pool of threads per process, kept between saves: a small save on local
disk takes a few milliseconds, of which starting threads anew each time would be a good share.
Where a store answers on this machine (``Location.answers_locally``: local disk, ``memory://``)
there is no round trip to hide, and small reads run ``one_by_one`` on the calling thread: handing
each to another thread, and the GIL back and forth, cost more than the reads (a 4-key local load
took twice as long).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# The shared pool's threads; more calls at once wait for a free one.
MAX_AT_ONCE = 16

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid: int | None = None
_in_pool = threading.local()


def at_once(calls: Sequence[Callable[[], Any]], *, one_by_one: bool = False) -> list[Any]:
    """Run every call, side by side, and return their results in order.

    The first call runs on the calling thread, the others on the shared pool (one call uses no
    other thread). Every call finishes before anything is raised; then the first failure, in the
    order of ``calls``, is raised.

    Args:
        calls: the calls, independent of each other. A call may itself use :func:`at_once`
            (it then gets threads of its own, never waiting for the pool it runs on).
        one_by_one: run them in order on the calling thread instead, with the same results and
            the same error (for reads a store answers on this machine).
    """
    if one_by_one:
        return _one_by_one(calls)
    if len(calls) <= 1:
        return [call() for call in calls]
    if getattr(_in_pool, "yes", False):
        with ThreadPoolExecutor(
            max_workers=min(len(calls) - 1, MAX_AT_ONCE), thread_name_prefix="dcp-fsspec-nested"
        ) as own:
            return _run(own, calls)
    return _run(_shared_pool(), calls)


def _run(pool: ThreadPoolExecutor, calls: Sequence[Callable[[], Any]]) -> list[Any]:
    others = [pool.submit(call) for call in calls[1:]]
    try:
        first = calls[0]()
    finally:
        errors = [f.exception() for f in others]  # waits for every one
    for error in errors:
        if error is not None:
            raise error
    return [first, *(f.result() for f in others)]


def _one_by_one(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = []
    first_error: Exception | None = None
    for call in calls:
        try:
            results.append(call())
        except Exception as e:  # every call still runs, as side by side
            first_error = first_error or e
            results.append(None)
    if first_error is not None:
        raise first_error
    return results


def _shared_pool() -> ThreadPoolExecutor:
    """This process's pool (a forked child makes its own: the parent's threads are not in it)."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(
                max_workers=MAX_AT_ONCE,
                thread_name_prefix="dcp-fsspec-at-once",
                initializer=_mark_pool_thread,
            )
            _pool_pid = os.getpid()
        return _pool


def _mark_pool_thread() -> None:
    _in_pool.yes = True
