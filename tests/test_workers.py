"""The storage layer's shared thread pools: one read's tasks are closed as a unit, and a done
task's result is not kept (a long load submits thousands, each holding a span's bytes)."""

from __future__ import annotations

import gc
import threading
import weakref

from dcp_fsspec.storage.transport.workers import Workers

WAIT = 30.0


def test_close_cancels_what_has_not_started_and_waits_for_what_has() -> None:
    workers = Workers("test-close", 1)
    running, go = threading.Event(), threading.Event()

    def blocking() -> str:
        running.set()
        assert go.wait(WAIT)
        return "done"

    first = workers.submit(blocking)
    queued = workers.submit(lambda: "never")
    assert running.wait(WAIT)
    cancelled = threading.Event()
    queued.add_done_callback(lambda _: cancelled.set())
    closer = threading.Thread(target=workers.close)
    closer.start()
    assert cancelled.wait(WAIT)
    assert queued.cancelled()
    assert closer.is_alive() and not first.done()  # close waits for the running task
    go.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert first.result() == "done"


def test_close_waits_for_failed_tasks_without_raising_their_errors() -> None:
    with Workers("test-fail", 2) as workers:
        failed = workers.submit(lambda: 1 / 0)
    assert isinstance(failed.exception(0), ZeroDivisionError)


class _Chunk:
    """A stand-in for a span's bytes (``bytes`` cannot be weakly referenced)."""


def test_done_tasks_results_are_not_kept() -> None:
    workers = Workers("test-forget", 4)
    futures = [workers.submit(_Chunk) for _ in range(200)]
    refs = [weakref.ref(f.result(WAIT)) for f in futures]
    del futures
    gc.collect()
    assert all(ref() is None for ref in refs)
    workers.close()


def test_reads_of_one_role_and_size_share_their_threads() -> None:
    names: set[str] = set()
    for _ in range(20):
        with Workers("test-share", 2) as workers:
            workers.submit(lambda: names.add(threading.current_thread().name)).result(WAIT)
    assert 1 <= len(names) <= 2, names
    assert all(name.startswith("dcp-fsspec-test-share") for name in names)


def test_no_threads_runs_each_task_on_the_callers_thread_as_it_is_submitted() -> None:
    seen: list[str] = []
    before = threading.active_count()
    with Workers("test-inline", 0) as workers:
        done = workers.submit(lambda n: seen.append(threading.current_thread().name) or n * 2, 21)
        assert done.done() and done.result() == 42  # done before submit returned
        failed = workers.submit(lambda: 1 / 0)
        assert failed.done() and isinstance(failed.exception(), ZeroDivisionError)
    assert seen == [threading.current_thread().name]
    assert threading.active_count() == before
    assert not any(t.name.startswith("dcp-fsspec-test-inline") for t in threading.enumerate())
