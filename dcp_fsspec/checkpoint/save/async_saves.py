"""The asynchronous side of a Checkpointer: staging buffers, the background saver, the save in flight.

At most one save is in flight. Its state is copied into reusable staging buffers, handed to the
background process (or, for ``memory://``, a thread of this process), and remembered until a
wait sees it committed. A saver that died is forgotten, so the next save starts another.
The buffers may be prepared before the first save, on a thread (:meth:`AsyncSaves.prepare`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.checkpoint.save.background import BackgroundSaver, ThreadSaver
from dcp_fsspec.checkpoint.save.pipeline import Saved, SavePipeline, SaveSettings
from dcp_fsspec.checkpoint.save.staging import Stager
from dcp_fsspec.errors import BackgroundSaveError, InvalidURLError
from dcp_fsspec.storage.transport.urls import Location

_T = TypeVar("_T")


@dataclass(frozen=True)
class InFlight:
    """A save until its ``save_end`` report: what it was given, then (once committed) what it did."""

    iteration: int
    keys: tuple[str, ...]
    nbytes: int
    started: float  # time.perf_counter() when save() was called
    saved: Saved | None = None


class AsyncSaves:
    """Saves in the background, one at a time.

    Args:
        settings: what the background process builds its save pipeline from.
        pipeline: the training process's own pipeline (a ``memory://`` thread runs it).
        root: where the saves commit.
        collectives: the ranks that save together.
        on_start: called once the first saver starts (the Checkpointer's exit hook).
    """

    def __init__(
        self,
        settings: SaveSettings,
        pipeline: SavePipeline,
        root: Location,
        collectives: Collectives,
        on_start: Callable[[], None],
    ) -> None:
        self._settings = settings
        self._pipeline = pipeline
        self._root = root
        self._collectives = collectives
        self._on_start = on_start
        self._stager: Stager | None = None
        self.saver: BackgroundSaver | ThreadSaver | None = None
        self.in_flight: InFlight | None = None

    def start(self) -> BackgroundSaver | ThreadSaver:
        """The background saver, started if there is none; it returns without waiting for it.

        Raises:
            InvalidURLError: several ranks and a ``memory://`` root, which lives in one process.
        """
        if self.saver is None:
            if not self._root.backend.shared_across_processes:
                if self._collectives.distributed:
                    raise InvalidURLError(
                        f"async_mode='async_with_pinned_mem' with several ranks cannot save to {self._root.url}: "
                        "memory:// lives in one process; use a local path or an object store"
                    )
                self.saver = ThreadSaver(self._pipeline.run)
            else:
                self.saver = BackgroundSaver(self._settings, self._collectives)
            self._on_start()
        return self.saver

    def submit(
        self, iteration: int, state_dicts: dict[str, dict[str, Any]], token: str | None, done: InFlight
    ) -> None:
        """Stage ``state_dicts`` and hand them to the saver; the caller waited for the previous save.

        Args:
            done: what the ``save_end`` report will say once the save is committed.
        """
        saver = self.start()
        # One stage over every key: a buffer's place includes its key, and each stage keeps only
        # the buffers it used.
        staged = self._the_stager().stage(state_dicts)
        self._surviving(lambda: saver.submit(iteration, staged, token))
        self.in_flight = done

    def prepare(self, state_dicts: dict[str, dict[str, Any]]) -> None:
        """Allocate the staging buffers of ``state_dicts`` on a thread; the next save waits for it.

        The background process receives them as soon as they exist, so the first save hands it
        only their tokens, as later saves do.
        """
        buffers = self._the_stager().prepare(state_dicts)
        if isinstance(self.saver, BackgroundSaver):
            self.saver.hand_over(buffers)

    def _the_stager(self) -> Stager:
        if self._stager is None:
            self._stager = Stager()
        return self._stager

    def wait(self, timeout: float | None = None) -> InFlight | None:
        """Wait for the save in flight; return it once committed, with what it did (None: there was none).

        Raises:
            TimeoutError: ``timeout`` seconds passed first; the save is still in flight.
            BackgroundSaveError: the saver died (it is forgotten).
            Exception: the save's own error.
        """
        saver = self.saver
        saved = None if saver is None else self._surviving(lambda: saver.wait(timeout))
        done, self.in_flight = self.in_flight, None
        return None if done is None else dataclasses.replace(done, saved=saved)

    def close(self) -> None:
        """Stop the saver and free the staging buffers."""
        saver, self.saver = self.saver, None
        try:
            if saver is not None:
                saver.close()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _surviving(self, call: Callable[[], _T]) -> _T:
        """Run ``call``; if the saver died, forget it so the next save starts another."""
        try:
            return call()
        except BackgroundSaveError:
            dead, self.saver = self.saver, None
            if dead is not None:
                dead.close()
            raise
