"""The drain: copying locally committed iterations to the durable ``save_dirname``, one at a time.

With a local tier, a save commits under ``local_dirname`` first; :class:`Drainer` then copies that
iteration's files to ``save_dirname`` in a background thread and commits it there with the same
rules as a direct save (:func:`.commit.publish`: every key's ``.metadata`` carries the save's
token and names files that are there, the commit record is created, the pointer moves by
compare-and-swap, never backwards). Files are copied, not re-serialised, by the storage layer's
concurrent uploads (:mod:`dcp_fsspec.storage.copying`). Only a committed local iteration is ever
copied; leftovers of a drain that died (a killed process) are cleared before the next copy.

One drain runs at a time. Saves faster than drains follow the policy: ``"every"`` makes the next
submit wait for the drain in flight (every iteration goes up), ``"latest"`` keeps one waiting
iteration and replaces it by a newer one (logged). A failed drain does not stop training: its
error is kept, returned by the next :meth:`Drainer.submit` (the caller warns) and raised by
:meth:`Drainer.wait`, until a later drain succeeds. The drain runs on rank 0 only, so it needs no
collective; ``local_dirname`` must then hold every rank's files (one node, or a shared folder).
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections.abc import Callable

from ..errors import DcpFsspecError, DrainError
from ..storage.copying import check_inside, copy_files, list_files
from ..storage.names import COMMIT_RECORD_NAME
from ..storage.urls import Location
from . import commit, layout, retention
from .events import CheckpointEvent

logger = logging.getLogger(__name__)

DRAIN_EVERY = "every"
DRAIN_LATEST = "latest"
DRAIN_POLICIES = (DRAIN_EVERY, DRAIN_LATEST)
# Not copied: the durable commit writes its own record, and the claim belongs to the local save.
_NOT_COPIED = frozenset({COMMIT_RECORD_NAME, commit.CLAIM_NAME})


def drain_iteration(
    local: Location, durable: Location, iteration: int, *, keep_last_n: int | None, workers: int = 8
) -> tuple[tuple[str, ...], int]:
    """Copy the committed local ``iteration`` to ``durable``, commit it there, apply retention.

    Args:
        local: the ``local_dirname`` location.
        durable: the ``save_dirname`` location.
        iteration: an iteration committed under ``local``.
        keep_last_n: the durable tier's retention; ``None`` keeps everything.
        workers: files copied at once.

    Returns:
        The keys of the iteration and the file bytes copied (0 when nothing needed copying).

    Raises:
        DrainError: the local iteration is not committed, or copying or committing failed; the
            durable pointer did not move. The message names both folders.
    """
    src = local.url_of(layout.iteration_path(local, iteration))
    dst = durable.url_of(layout.iteration_path(durable, iteration))
    try:
        record, why = commit.inspect_iteration(local, iteration)
        if record is None:
            raise DrainError(
                f"not copying {src} to {dst}: the local copy {why}, and a durable copy is only made of a "
                "committed one; save the iteration again"
            )
        latest = commit.read_pointer(durable)
        if latest is not None and latest >= iteration:
            if latest > iteration:
                logger.info("not draining %s: %s already names the newer %s", src, commit.pointer_url(durable),
                            layout.format_iteration(latest))  # fmt: skip
            return record.keys, 0
        nbytes = 0
        durable_record, reason = commit.inspect_iteration(durable, iteration)
        if durable_record is None:
            if reason != "does not exist":
                logger.info("clearing %s, left by a drain that never committed (%s)", dst, reason)
                commit.discard_iteration(durable, iteration)
            files = {
                name: size
                for name, size in list_files(local, layout.iteration_path(local, iteration)).items()
                if posixpath.basename(name) not in _NOT_COPIED
            }
            check_inside(local, files)
            logger.info("draining %s to %s (%d files, %.1f MiB)", src, dst, len(files), sum(files.values()) / 2**20)
            copy_files(local, durable, files, workers=workers)
            nbytes = sum(files.values())
            logger.debug("copied %s to %s; committing it there", src, dst)
            latest = commit.publish(
                durable, iteration, record.keys, record.world_size, save_id=record.save_id
            )
        else:  # committed by a drain that died before moving the pointer
            latest = iteration if commit.write_pointer(durable, iteration) else commit.read_pointer(durable)
        logger.info("committed %s (the durable copy of %s)", dst, src)
        if keep_last_n is not None:
            retention.apply_retention(durable, keep_last_n, protected=(iteration,), latest=latest)
        return record.keys, nbytes
    except DrainError:
        raise
    except (OSError, DcpFsspecError) as e:
        raise DrainError(
            f"could not copy {src} to the durable tier {dst}: {e}; the pointer {commit.pointer_url(durable)} "
            "stays on its previous iteration, the local copy is kept, and the next save drains again"
        ) from e


class Drainer:
    """One background thread that drains iterations, one at a time, under a policy.

    Args:
        local: the ``local_dirname`` location.
        durable: the ``save_dirname`` location.
        policy: :data:`DRAIN_EVERY` or :data:`DRAIN_LATEST`.
        keep_last_n: the durable tier's retention.
        on_end: called (in the drain thread) with a ``drain_end`` event after each drain.
    """

    def __init__(
        self,
        local: Location,
        durable: Location,
        *,
        policy: str,
        keep_last_n: int | None,
        on_end: Callable[[CheckpointEvent], None],
    ) -> None:
        if policy not in DRAIN_POLICIES:
            raise ValueError(f"drain={policy!r} is not supported; choose one of {list(DRAIN_POLICIES)}")
        self._local = local
        self._durable = durable
        self._policy = policy
        self._keep_last_n = keep_last_n
        self._on_end = on_end
        self._cond = threading.Condition()
        self._running: int | None = None
        self._waiting: int | None = None
        self._thread: threading.Thread | None = None
        self._error: DrainError | None = None

    def submit(self, iteration: int) -> DrainError | None:
        """Drain ``iteration`` (committed locally) after the drain in flight, per the policy.

        Returns:
            The error of the last finished drain if it failed (the durable tier is behind).
        """
        with self._cond:
            if self._policy == DRAIN_EVERY:
                self._cond.wait_for(lambda: self._running is None and self._waiting is None)
            failure, replaced = self._error, self._waiting
            self._waiting = iteration
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="dcp-fsspec-drain", daemon=True)
                self._thread.start()
        if replaced is not None:
            logger.info(
                "drain='latest': %s is replaced by %s before being copied to %s (a drain was in flight)",
                layout.format_iteration(replaced), layout.format_iteration(iteration), self._durable.url,
            )  # fmt: skip
        return failure

    def undrained(self) -> set[int]:
        """The iterations in flight or waiting: local retention must keep them."""
        with self._cond:
            return {i for i in (self._running, self._waiting) if i is not None}

    def wait(self, timeout: float | None = None) -> None:
        """Block until no drain is in flight or waiting; raise the last drain's error, if it failed.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            DrainError: the last drain failed: the durable tier is behind the local one.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._running is None and self._waiting is None, timeout):
                raise TimeoutError(
                    f"the drain of {layout.format_iteration(self._running or 0)} to {self._durable.url} did not "
                    f"finish within {timeout} s; it goes on in the background"
                )
            if self._error is not None:
                raise self._error

    def _serve(self) -> None:
        while True:
            with self._cond:
                if self._waiting is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
                iteration, self._waiting = self._waiting, None
                self._running = iteration
            error: DrainError | None = None
            keys: tuple[str, ...] = ()
            nbytes, start = 0, time.perf_counter()
            try:
                keys, nbytes = drain_iteration(self._local, self._durable, iteration, keep_last_n=self._keep_last_n)
            except DrainError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - kept and raised by wait(), like any drain failure
                error = DrainError(f"draining {layout.format_iteration(iteration)} to {self._durable.url} failed: {e!r}")
            if error is not None:
                logger.warning("%s", error)
            url = self._durable.url_of(layout.iteration_path(self._durable, iteration))
            event = CheckpointEvent(
                "drain_end", iteration, url, keys, nbytes, time.perf_counter() - start, tier="durable",
                error=None if error is None else str(error),
            )  # fmt: skip
            try:
                self._on_end(event)  # before wait() returns, so a caller that waited has seen it
            except Exception as e:  # noqa: BLE001 - a callback's bug must not stop the drains
                logger.warning("the on_drain_end callback failed for %s: %r", url, e)
            with self._cond:
                self._running = None
                # A later drain that succeeds brings the durable tier up to date: the failure is over.
                self._error = error
                self._cond.notify_all()
