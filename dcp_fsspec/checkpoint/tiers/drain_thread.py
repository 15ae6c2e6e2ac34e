"""The drain thread: one per rank, draining locally committed iterations one at a time.

Every rank's :class:`Drainer` is handed the same jobs in the same order and runs
:func:`~dcp_fsspec.checkpoint.tiers.drain.drain_iteration` for each on a thread of its own, which runs no collective. Saves
faster than drains follow the policy: ``"every"`` makes the next submit wait for the drain in
flight; ``"latest"`` drops waiting iterations (the same on every rank: see
:meth:`Drainer.paused`). A failed drain does not stop training: the next :meth:`Drainer.submit`
returns its error (the caller warns) and :meth:`Drainer.wait` raises it, until a drain succeeds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.checkpoint.events import CheckpointEvent
from dcp_fsspec.checkpoint.options import DRAIN_EVERY, DRAIN_POLICIES
from dcp_fsspec.checkpoint.tiers.drain import MARKER_WAIT_SECONDS, DrainJob, drain_iteration
from dcp_fsspec.errors import DrainError
from dcp_fsspec.storage.transport.urls import Location

logger = logging.getLogger(__name__)


class Drainer:
    """One background thread that drains iterations on this rank, one at a time, under a policy.

    Every rank has one and is handed the same jobs in the same order; the thread runs no
    collective (see the module docstring).

    Args:
        local: this rank's ``local_dirname`` location.
        durable: the ``save_dirname`` location.
        policy: :data:`DRAIN_EVERY` or :data:`DRAIN_LATEST`.
        keep_last_n: the durable tier's retention.
        on_end: called (in the drain thread, on rank 0) with a ``drain_end`` event after each drain.
        rank, world_size: this rank, and how many ranks drain each iteration.
        marker_wait, per_node: see :func:`drain_iteration`.
    """

    def __init__(
        self,
        local: Location,
        durable: Location,
        *,
        policy: str,
        keep_last_n: int | None,
        on_end: Callable[[CheckpointEvent], None],
        rank: int = 0,
        world_size: int = 1,
        marker_wait: float = MARKER_WAIT_SECONDS,
        per_node: bool = False,
    ) -> None:
        if policy not in DRAIN_POLICIES:
            raise ValueError(f"drain={policy!r} is not supported; choose one of {list(DRAIN_POLICIES)}")
        self._local = local
        self._durable = durable
        self.policy = policy
        self._keep_last_n = keep_last_n
        self._on_end = on_end
        self._rank = rank
        self._world_size = world_size
        self._marker_wait = marker_wait
        self._per_node = per_node
        self._cond = threading.Condition()
        self._running: int | None = None
        self._waiting: list[DrainJob] = []
        self._paused = False
        self._thread: threading.Thread | None = None
        self._error: DrainError | None = None

    @contextmanager
    def paused(self) -> Iterator[list[int]]:
        """Start no waiting job while inside; yields the waiting iterations.

        The caller agrees with the other ranks which waiting iterations to drop (only those no
        rank has started: rank 0 would wait for markers that never come) and passes them to
        :meth:`submit` before leaving.
        """
        with self._cond:
            self._paused = True
            waiting = [job.iteration for job in self._waiting]
        try:
            yield waiting
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def submit(self, job: DrainJob, *, drop: Collection[int] = ()) -> DrainError | None:
        """Drain ``job`` after the drain in flight; with :data:`DRAIN_EVERY` first wait for it.

        Args:
            job: the iteration committed locally, and its token.
            drop: waiting iterations that go up no more (:data:`DRAIN_LATEST`; logged).

        Returns:
            The error of the last finished drain if it failed (the durable tier is behind).
        """
        with self._cond:
            if self.policy == DRAIN_EVERY:
                self._cond.wait_for(lambda: self._running is None and not self._waiting)
            failure = self._error
            dropped = [j.iteration for j in self._waiting if j.iteration in drop]
            self._waiting = [j for j in self._waiting if j.iteration not in drop] + [job]
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="dcp-fsspec-drain", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if dropped and self._rank == 0:
            logger.info(
                "drain='latest': %s is replaced by %s before being copied to %s (a drain was in flight)",
                ", ".join(map(layout.format_iteration, dropped)),
                layout.format_iteration(job.iteration),
                self._durable.url,
            )
        return failure

    def undrained(self) -> set[int]:
        """The iterations in flight or waiting: local retention must keep them."""
        with self._cond:
            return {j.iteration for j in self._waiting} | (
                {self._running} if self._running is not None else set()
            )

    def wait(self, timeout: float | None = None) -> None:
        """Block until no drain is in flight or waiting; raise the last drain's error, if it failed.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            DrainError: the last drain failed: the durable tier is behind the local one.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._running is None and not self._waiting, timeout):
                raise TimeoutError(
                    f"the drain of {layout.format_iteration(self._running or 0)} to {self._durable.url} did not "
                    f"finish within {timeout} s; it goes on in the background"
                )
            if self._error is not None:
                raise self._error

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._paused)
                if not self._waiting:
                    self._thread = None
                    self._cond.notify_all()
                    return
                job = self._waiting.pop(0)
                self._running = job.iteration
            error = self._drain(job)
            with self._cond:
                self._running = None
                # A later drain that succeeds brings the durable tier up to date: the failure is over.
                self._error = error
                self._cond.notify_all()

    def _drain(self, job: DrainJob) -> DrainError | None:
        """Drain one job; report it (rank 0); return its error."""
        error: DrainError | None = None
        keys: tuple[str, ...] = ()
        nbytes, start = 0, time.perf_counter()
        try:
            keys, nbytes = drain_iteration(
                self._local,
                self._durable,
                job,
                rank=self._rank,
                world_size=self._world_size,
                keep_last_n=self._keep_last_n,
                marker_wait=self._marker_wait,
                per_node=self._per_node,
            )
        except DrainError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - kept and raised by wait(), like any drain failure
            error = DrainError(
                f"draining {layout.format_iteration(job.iteration)} to {self._durable.url} failed: {e!r}"
            )
        if error is not None:
            logger.warning("%s", error)
        if self._rank != 0:
            return error
        url = self._durable.url_of(layout.iteration_path(self._durable, job.iteration))
        event = CheckpointEvent(
            "drain_end",
            job.iteration,
            url,
            keys,
            nbytes,
            time.perf_counter() - start,
            tier="durable",
            error=None if error is None else str(error),
        )
        try:
            self._on_end(event)  # before wait() returns, so a caller that waited has seen it
        except Exception as e:  # noqa: BLE001 - a callback's bug must not stop the drains
            logger.warning("the on_drain_end callback failed for %s: %r", url, e)
        return error
