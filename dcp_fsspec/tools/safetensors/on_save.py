"""Exporting a Checkpointer's committed iterations to safetensors, on a thread of its own.

Pass a :class:`SafetensorsExport` as the Checkpointer's ``on_event``. On a ``save_end`` it only
queues the committed iteration; its own thread exports the iteration's ``model`` key with
:func:`~dcp_fsspec.tools.safetensors.export.export_safetensors`. A failed export is a WARNING, never an error
of training; :meth:`SafetensorsExport.wait` and :meth:`SafetensorsExport.close` raise it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

from dcp_fsspec.checkpoint.events import CheckpointEvent
from dcp_fsspec.tools.safetensors.export import DEFAULT_MAX_SHARD_SIZE, KeyMap, export_safetensors

logger = logging.getLogger(__name__)


class SafetensorsExport:
    """Export every ``every``-th committed iteration's ``model`` key as a safetensors folder.

    Example::

        export = SafetensorsExport("s3://bucket/hf/step-{iteration}", every=1000, dtype=torch.bfloat16,
                                   storage_options=opts)
        with Checkpointer("s3://bucket/run", opts, async_mode="async_with_pinned_mem", on_event=export) as ckpt:
            ...
        export.close()

    The training thread only queues an iteration. If a newer one commits while an older one is
    still queued, the newer replaces it. Keep ``keep_last_n`` of at least 2, so retention does
    not delete an iteration while it is exported.

    Args:
        dst_url: the folder to write (any URL). ``{iteration}`` in it becomes the iteration;
            without it, each export replaces the last.
        every: export the iterations that are multiples of ``every``.
        dtype, key_map, max_shard_size: as :func:`~dcp_fsspec.tools.safetensors.export.export_safetensors` takes them.
        storage_options: the options of the Checkpointer's storage.
        out_storage_options: the options of ``dst_url``'s storage; default ``storage_options``.
        rank: the rank that exports (of the default group); the others ignore every event.
    """

    def __init__(
        self,
        dst_url: str,
        *,
        every: int = 1,
        dtype: torch.dtype | None = None,
        key_map: KeyMap | None = None,
        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
        storage_options: dict[str, Any] | None = None,
        out_storage_options: dict[str, Any] | None = None,
        rank: int = 0,
    ) -> None:
        if every < 1:
            raise ValueError(f"every={every!r} must be at least 1 (exporting to {dst_url})")
        self.dst_url = dst_url
        self.every = every
        self.rank = rank
        self._options: dict[str, Any] = {"dtype": dtype, "key_map": key_map, "max_shard_size": max_shard_size}
        self._storage_options = storage_options
        self._out_storage_options = storage_options if out_storage_options is None else out_storage_options
        self._cond = threading.Condition()
        self._queued: CheckpointEvent | None = None
        self._busy = False
        self._closed = False
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None

    def out_url(self, iteration: int) -> str:
        """Where ``iteration`` is exported."""
        return self.dst_url.replace("{iteration}", str(iteration))

    def __call__(self, event: CheckpointEvent) -> None:
        """Queue a committed iteration for export; ignore every other event."""
        if event.kind != "save_end" or event.iteration % self.every or not self._exports_here():
            return
        with self._cond:
            if self._closed:
                logger.warning(
                    "not exporting %s to %s: the SafetensorsExport is closed",
                    event.url,
                    self.out_url(event.iteration),
                )
                return
            if self._queued is not None:
                logger.info(
                    "not exporting %s: %s committed before its export began", self._queued.url, event.url
                )
            self._queued = event
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dcp-fsspec-safetensors-export", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until every queued export is done; raise the last failure since the last call."""
        with self._cond:
            self._cond.wait_for(lambda: self._queued is None and not self._busy)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the queued exports, stop the thread, and raise the last failure if any."""
        try:
            self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
                thread = self._thread
            if thread is not None:
                thread.join()

    def _exports_here(self) -> bool:
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == self.rank

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closed)
                event, self._queued = self._queued, None
                if event is None:
                    return
                self._busy = True
            try:
                self._export(event)
            except Exception as e:  # noqa: BLE001 - training goes on; wait() and close() raise it
                logger.warning("exporting %s to %s failed: %s", event.url, self.out_url(event.iteration), e)
                with self._cond:
                    self._error = e
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _export(self, event: CheckpointEvent) -> None:
        out = self.out_url(event.iteration)
        export_safetensors(
            event.url, out, self._storage_options, self._out_storage_options, overwrite=True, **self._options
        )
        logger.info("exported %s to %s", event.url, out)
