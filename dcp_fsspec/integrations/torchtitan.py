"""torchtitan checkpoints on any fsspec URL, written and read by dcp_fsspec.

:class:`FsspecCheckpointManager` is torchtitan's ``CheckpointManager`` (torchtitan 0.3) with
its own ``Config``, so the trainer builds it when the job's Python config names it::

    checkpoint=FsspecCheckpointManager.Config(
        enable=True, folder="s3://bucket/run/checkpoint", interval=500, keep_latest_k=3,
        storage_options={"endpoint_url": "https://…"}, async_mode="async",
    )

Its ``dcp_save``/``dcp_load`` (torchtitan's seams) write every step with
:class:`~dcp_fsspec.FsspecStorageWriter` and read it with
:class:`~dcp_fsspec.FsspecStorageReader`, synchronously or in torchtitan's two async modes
(``"async"``: a thread; ``"async_with_pinned_mem"``: torch's background process). Finding the
step to resume, checking that a step exists and deleting old steps (``keep_latest_k``, in
torchtitan's purge thread) go through the same storage options, where torchtitan itself uses
``os``/``shutil`` or fsspec's defaults. torchtitan's layout is kept: ``folder/step-N``, a step
counting once its ``.metadata`` (written last) is there, the model-only last step and step 0.
Hugging Face safetensors exports and imports (``last_save_in_hf``, ``initial_load_in_hf``) stay
torchtitan's own, on local disk, as torchtitan allows them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dcp_fsspec.integrations._files import (
    blocking,
    child,
    exists,
    is_dcp_checkpoint,
    locate,
    remove,
    require,
    unwrapped,
)

require("torchtitan.components.checkpointer", "torchtitan", "dcp_fsspec.integrations.torchtitan")

import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import purge_thread
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

from dcp_fsspec.errors import CheckpointNotFoundError
from dcp_fsspec.storage.format.safe_entries import SafeLoadPlanner
from dcp_fsspec.storage.read.reader import FsspecStorageReader
from dcp_fsspec.storage.settings import ReaderSettings, WriterSettings
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, RetryPolicy
from dcp_fsspec.storage.transport.urls import Location, redact_text, redact_url
from dcp_fsspec.storage.write.writer import FsspecStorageWriter

__all__ = ["FsspecCheckpointManager"]

# torchtitan's step folders, and the file that marks a Hugging Face export as complete.
STEP_NAME = re.compile(r"step-([0-9]{1,18})")
HF_INDEX = "model.safetensors.index.json"
REDACTED = "<redacted>"


class FsspecCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager``, saving to and resuming from any fsspec URL.

    Built by the trainer from :class:`FsspecCheckpointManager.Config`; its arguments are
    torchtitan's own (``dataloader``, ``model_parts``, ``optimizers``, ``lr_schedulers``,
    ``states``, ``sd_adapter``, ``base_folder``). A ``folder`` with a scheme is used as it is; a
    plain one is joined to ``base_folder`` (the dump folder), as torchtitan does.
    """

    purge_thread: threading.Thread | None  # torchtitan's, until __init__ puts ours in its place

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint settings, plus where and how dcp_fsspec reaches storage."""

        storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
        """fsspec options for ``folder`` and ``initial_load_path`` (credentials, endpoint); kept
        out of the config's ``repr`` and ``to_dict`` (which torchtitan logs and saves)."""

        writer_settings: WriterSettings = field(default_factory=WriterSettings)
        """The tuning of our storage writer (part size, files per rank, compression, …)."""

        reader_settings: ReaderSettings = field(default_factory=ReaderSettings)
        """The tuning of our storage reader (window, request size, threads, …). Its
        ``trust_checkpoint=True`` loads non-tensor entries in full (runs any code they hold):
        only for checkpoints you wrote. By default they load as ``torch.load(weights_only=True)``
        does."""

        retry: RetryPolicy | None = DEFAULT_RETRY
        """How storage calls are retried; ``None``: only the driver's own retries."""

        def __repr__(self) -> str:
            return redact_text(CheckpointManager.Config.__repr__(self))

        def to_dict(self) -> dict[str, Any]:
            """torchtitan's dict of the settings, with no secret in it: the storage options'
            values and any password in a URL are redacted."""
            settings: dict[str, Any] = CheckpointManager.Config.to_dict(self)
            settings["storage_options"] = {key: REDACTED for key in self.storage_options}
            for name in ("folder", "initial_load_path"):
                if settings[name]:
                    settings[name] = redact_url(settings[name])
            return settings

    def __init__(self, config: Config, **components: Any) -> None:
        super().__init__(config, **components)
        if not self.enable:
            return
        self.storage_options = dict(config.storage_options)
        self.writer_settings = config.writer_settings
        self.reader_settings = config.reader_settings
        self.retry = config.retry
        self._saving = ""  # the step the latest save wrote (or an async one writes)
        if self.purge_thread is not None:
            # torchtitan's purge thread deletes with os/shutil or fsspec's default options: one
            # that deletes through ours takes its place, on the same queue.
            self.purge_queue.put(None)
            self.purge_thread.join()
            self.purge_thread = threading.Thread(
                target=purge_thread,
                args=(self.purge_queue, self._remove),
                daemon=True,
                name="dcp-fsspec-purge",
            )
            self.purge_thread.start()

    # -- torchtitan's seams -----------------------------------------------------------------------

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        """Write ``state_dict`` as the DCP checkpoint ``checkpoint_id`` with our storage writer.

        Returns what torchtitan expects of each ``async_mode``: ``None`` once written
        (``DISABLED``), the write's future (``ASYNC``), or torch's staging and upload futures
        (``ASYNC_WITH_PINNED_MEM``). ``to_hf`` (a local safetensors export) is torchtitan's own.
        """
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = FsspecStorageWriter(
            checkpoint_id,
            self.storage_options,
            settings=self.writer_settings,
            retry=self.retry,
            overwrite=True,
        )
        response: Future[Any] | AsyncSaveResponse | None = None
        self._saving = checkpoint_id
        if async_mode == AsyncMode.DISABLED:
            blocking(
                lambda: dcp.save(state_dict, storage_writer=writer), f"saving {redact_url(checkpoint_id)}"
            )
        else:
            pinned = async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
            response = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS
                if pinned
                else AsyncCheckpointerType.THREAD,
                async_stager=self.stager if pinned else None,
            )
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return response

    def dcp_load(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        """Read the DCP checkpoint ``checkpoint_id`` into ``state_dict`` with our storage reader,
        then into the model. ``from_hf`` (safetensors on local disk) is torchtitan's own."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        reader = FsspecStorageReader(
            checkpoint_id, self.storage_options, settings=self.reader_settings, retry=self.retry
        )
        planner = SafeLoadPlanner(trust_checkpoint=self.reader_settings.trust_checkpoint)
        blocking(
            lambda: dcp.load(state_dict, storage_reader=reader, planner=planner),
            f"loading {redact_url(checkpoint_id)}",
            reader=reader,
        )
        # The model's entries are flattened into state_dict (torchtitan's layout): load them back.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _wait_for_saving(self) -> None:
        """Wait for the async save in flight; its failure is raised as one of our errors."""
        unwrapped(super()._wait_for_saving, f"saving {redact_url(self._saving)}")

    # -- finding, loading and deleting steps through our storage options --------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Resume from ``step`` of ``folder`` (``-1``: the newest complete one); with none there,
        load ``initial_load_path`` (or the HF assets) as torchtitan would; else start afresh.

        Raises:
            CheckpointNotFoundError: ``step`` (or ``initial_load_path``) holds no checkpoint.
        """
        if step == -1:
            step = self._find_load_step()
        elif not self._is_complete(where := self._locate(self._create_checkpoint_id(step))):
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: no checkpoint at {where.url} (no .metadata); "
                "choose a step that was saved, or -1 for the newest"
            )
        if step != -1:
            # Step 0 is torchtitan's seed checkpoint, which holds the model only.
            checkpoint_id, model_only, from_hf, from_quantized = (
                self._create_checkpoint_id(step),
                step == 0,
                False,
                False,
            )
        elif self.initial_load_path or self.initial_load_in_hf:
            checkpoint_id = self._initial_load_source()
            model_only, from_hf = self.initial_load_model_only, self.initial_load_in_hf
            from_quantized = self.initial_load_in_hf_quantized
        else:
            logger.info("No checkpoint was provided, this is a fresh start.")
            return False
        logger.info(f"Loading the checkpoint from {redact_url(checkpoint_id)}.")
        self.dcp_load(self._states_to_load(model_only), checkpoint_id, from_hf, from_quantized)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True

    def _initial_load_source(self) -> str:
        """Where a run with no checkpoint in ``folder`` starts from (a DCP checkpoint, or HF assets)."""
        if self.initial_load_path and not self.initial_load_in_hf:
            where = self._locate(self.initial_load_path)
            if not is_dcp_checkpoint(where):
                raise CheckpointNotFoundError(
                    f"checkpoint.initial_load_path={where.url} holds no DCP checkpoint (no .metadata): fix the path"
                )
            return self.initial_load_path
        source = self.initial_load_path or (self.sd_adapter.hf_assets_path if self.sd_adapter else None)
        if not source:
            raise CheckpointNotFoundError(
                "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path or the model's hf_assets_path"
            )
        return str(source)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step under ``folder`` (default: ``self.folder``) whose checkpoint is
        complete (its ``.metadata``, or an HF export's index, is there), or ``-1``."""
        where = self._locate(folder or self.folder)
        for step, name in sorted(self._steps(where), reverse=True):
            if self._is_complete(child(where, name)):
                return step
        return -1

    def _should_purge(self) -> bool:
        # torchtitan's own also asks os/fsspec whether the folder exists: listing it says so.
        return self.keep_latest_k > 0 and (not dist.is_initialized() or dist.get_rank() == 0)

    def _purge_stale_checkpoints(self) -> None:
        """Queue all but the newest ``keep_latest_k`` step folders for deletion (rank 0), as
        torchtitan does: every ``step-N`` folder counts, complete or not.

        The step just saved counts even before its folder can be listed (an async save may not
        have written a file yet): it is one of the ``keep_latest_k`` kept, which is why
        torchtitan refuses ``keep_latest_k=1``. Otherwise an async run would keep one more.
        """
        if not self._should_purge():
            return
        where = self._locate(self.folder)
        steps = set(self._steps(where))
        saving = self._saving.rstrip("/").rpartition("/")
        if saving[0] == self.folder.rstrip("/") and (match := STEP_NAME.fullmatch(saving[2])):
            steps.add((int(match.group(1)), saving[2]))
        for _step, name in sorted(steps)[: -self.keep_latest_k]:
            self.purge_queue.put(child(where, name).url)

    def _remove(self, url: str) -> None:
        """Delete one step folder (torchtitan's purge thread calls it)."""
        remove(self._locate(url))

    def _locate(self, url: str) -> Location:
        return locate(url, self.storage_options, self.retry)

    def _steps(self, where: Location) -> list[tuple[int, str]]:
        """``(step, folder name)`` of every ``step-N`` folder under ``where``, complete or not."""
        where.backend.invalidate(where.path)  # a cached listing would hide other ranks' writes
        try:
            entries = where.backend.call("ls", where.path, detail=False)
        except FileNotFoundError:
            return []
        names = (str(entry).rstrip("/").rpartition("/")[2] for entry in entries)
        return [(int(match.group(1)), name) for name in names if (match := STEP_NAME.fullmatch(name))]

    @staticmethod
    def _is_complete(where: Location) -> bool:
        return is_dcp_checkpoint(where) or exists(child(where, HF_INDEX))
