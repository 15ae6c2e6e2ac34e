"""The Hugging Face ``Trainer`` saving to, and resuming from, any fsspec URL through dcp_fsspec.

:class:`FsspecTrainer` is a ``transformers.Trainer`` whose checkpoints are iterations of a
:class:`~dcp_fsspec.Checkpointer` at ``checkpoint_url`` instead of ``output_dir/checkpoint-N``
folders: the model, optimizer, LR scheduler, ``TrainerState`` and torch's RNG state, written by
our storage writer (sharded models as shards), committed, and pruned to ``save_total_limit``
remotely. On several processes (DDP) every rank takes part in each save and load (DCP writes
each replicated tensor once), and each rank's RNG state is kept apart, so every rank resumes
with its own. ``train(resume_from_checkpoint=True)`` resumes from the newest committed iteration;
``resume_from_checkpoint="s3://…/iter_000000040"`` (or the run's URL) from that one.

The Trainer's seams carry it: ``_save_checkpoint`` saves, and ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler`` and ``_load_rng_state`` load, when the Trainer resumes from
the local folder this class gives it, which holds only ``trainer_state.json`` (the Trainer reads
that file itself). Best-model tracking (``load_best_model_at_end``) and ``push_to_hub`` of
checkpoints are not carried over.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from typing import Any, cast

from dcp_fsspec.integrations._files import require

require("transformers", "hf", "dcp_fsspec.integrations.hf")

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer_callback import ExportableState

from dcp_fsspec.checkpoint import Checkpointer
from dcp_fsspec.checkpoint.commit.layout import parse_iteration
from dcp_fsspec.checkpoint.options import CheckpointerOptions
from dcp_fsspec.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidURLError
from dcp_fsspec.storage.transport.group_tensors import device_for
from dcp_fsspec.storage.transport.urls import normalize_url, redact_url

__all__ = ["FsspecTrainer"]

logger = logging.getLogger(__name__)

# The Trainer reads its state from this file in the folder it resumes from.
TRAINER_STATE_NAME = "trainer_state.json"


class FsspecTrainer(Trainer):
    """A ``transformers.Trainer`` that checkpoints to ``checkpoint_url`` (any fsspec URL).

    Args:
        *args, **kwargs: the ``Trainer``'s own. ``args.save_steps``/``save_strategy`` decide
            when to save, as usual; ``args.save_total_limit`` is the retention (newest kept).
        checkpoint_url: where iterations go (``s3://bucket/run/ckpt``, a local folder, …).
        storage_options: fsspec options for ``checkpoint_url`` (credentials, endpoint).
        checkpointer_options: the :class:`~dcp_fsspec.Checkpointer`'s other options
            (``async_mode``, ``writer_settings``, ``reader_settings``, ``retry``, …), except
            ``keep_last_n``: ``args.save_total_limit`` is the retention.

    Raises:
        UsageError: ``checkpointer_options`` sets ``keep_last_n``.
    """

    def __init__(
        self,
        *args: Any,
        checkpoint_url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        checkpointer_options: CheckpointerOptions | None = None,
        **kwargs: Any,
    ) -> None:
        options = checkpointer_options or CheckpointerOptions()
        options.require_default(
            f"FsspecTrainer({redact_url(os.fspath(checkpoint_url))!r})",
            {"keep_last_n": "set TrainingArguments(save_total_limit=...), the retention"},
        )
        super().__init__(*args, **kwargs)
        options = dataclasses.replace(options, keep_last_n=self.args.save_total_limit)
        self.checkpointer = Checkpointer(checkpoint_url, storage_options, **options.as_kwargs())
        self._resuming: tuple[str, int] | None = None  # (the local folder given to the Trainer, iteration)

    # -- saving ---------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Save this step as one iteration at ``checkpoint_url`` (the Trainer calls it)."""
        self.store_flos()
        # The callbacks' and the control's resumable state goes into TrainerState, as the Trainer's
        # own _save_checkpoint does before it writes trainer_state.json.
        stateful = cast(dict[str, Any], self.state.stateful_callbacks)  # a dict, whatever its annotation
        for exportable in [*self.callback_handler.callbacks, self.control]:
            if isinstance(exportable, ExportableState):
                name = type(exportable).__name__
                if isinstance(stateful.get(name), list):
                    stateful[name].append(exportable.state())
                else:
                    stateful[name] = exportable.state()
        state_json = json.dumps(dataclasses.asdict(self.state), sort_keys=True)
        self.checkpointer.save(
            self.state.global_step,
            model=self.model,
            optim=self.optimizer,
            scheduler=self.lr_scheduler,
            trainer={"state": state_json, "torch_rng": _every_ranks_rng_state()},
        )

    # -- resuming -------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, resuming from ``checkpoint_url`` when asked to.

        ``resume_from_checkpoint``: ``True`` (the newest committed iteration), ``checkpoint_url``
        itself (the same), or one iteration's URL (``…/iter_000000040``).
        """
        if not resume_from_checkpoint:
            output = super().train(None, *args, **kwargs)
            self.checkpointer.wait()  # the last asynchronous save, committed (or its error)
            return output
        iteration = self._iteration_named(resume_from_checkpoint)
        with tempfile.TemporaryDirectory(prefix="dcp-fsspec-resume-") as local:
            with open(os.path.join(local, TRAINER_STATE_NAME), "w") as f:
                f.write(self._load_trainer_entry(iteration)["state"])
            self._resuming = (local, iteration)
            try:
                output = super().train(local, *args, **kwargs)
            finally:
                self._resuming = None
        self.checkpointer.wait()
        return output

    def _iteration_named(self, resume_from_checkpoint: str | bool) -> int:
        url = self.checkpointer.url
        given = None if isinstance(resume_from_checkpoint, bool) else os.fspath(resume_from_checkpoint)
        if given is None or normalize_url(given) == url:
            named = self.checkpointer.latest_checkpoint()
            if named is None:
                raise CheckpointNotFoundError(
                    f"nothing to resume from: no committed iteration at {url}. On a run's first start pass "
                    "resume_from_checkpoint=trainer.checkpointer.latest_checkpoint() (None until a save commits), "
                    "as get_last_checkpoint(output_dir) is used with the Trainer's own checkpoints"
                )
            inside = True
        else:
            named = redact_url(given)
            # An iteration folder of another URL would load the same-numbered iteration from
            # ours: only a folder name, or a folder of checkpoint_url itself, is accepted.
            inside = "/" not in given or normalize_url(given).rstrip("/").rpartition("/")[0] == url
        iteration = parse_iteration(named.rstrip("/").rpartition("/")[2])
        if iteration is None or not inside:
            raise InvalidURLError(
                f"resume_from_checkpoint={named!r} is not an iteration of {url}: pass True, {url!r} "
                "or one of its iter_XXXXXXXXX folders"
            )
        return iteration

    def _ours(self, checkpoint: str | None) -> int | None:
        """The iteration being resumed when ``checkpoint`` is the folder :meth:`train` made."""
        if self._resuming is not None and checkpoint == self._resuming[0]:
            return self._resuming[1]
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The weights load with the optimizer (below), which needs the model beside it.
        if self._ours(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        iteration = self._ours(checkpoint)
        if iteration is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        self.checkpointer.load(iteration, model=self.model, optim=self.optimizer, scheduler=self.lr_scheduler)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._ours(checkpoint) is None:
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        iteration = self._ours(checkpoint)
        if iteration is None:
            super()._load_rng_state(checkpoint)
            return
        _restore_rng_state(self._load_trainer_entry(iteration)["torch_rng"], self.checkpointer.url, iteration)

    def _load_trainer_entry(self, iteration: int) -> dict[str, Any]:
        """The ``trainer`` entry of ``iteration``: the TrainerState's JSON and the ranks' RNG states."""
        trainer: dict[str, Any] = {"state": "", "torch_rng": b""}
        self.checkpointer.load(iteration, trainer=trainer)
        return trainer


def _every_ranks_rng_state() -> bytes:
    """Every rank's torch RNG state, in rank order, as one value the same on every rank.

    The ranks' states differ (each draws for its own batches), and a value every rank saves under
    one name is written once by DCP, so each state is gathered rather than saved as is. Bytes,
    not a tensor: a loaded tensor must match its placeholder's shape, which the number of ranks
    that saved would decide.
    """
    state = torch.get_rng_state()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # The Trainer's group is NCCL alone on GPUs: it carries the states on the GPU.
        local = state.to(device_for(None))
        states = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(states, local)
        state = torch.cat(states).cpu()
    return state.numpy().tobytes()


def _restore_rng_state(saved: bytes, url: str, iteration: int) -> None:
    """Set this rank's torch RNG state from :func:`_every_ranks_rng_state`'s ``saved`` bytes.

    Saved by another number of ranks, the states match none of these ranks: each keeps its own
    (as the Trainer does when its per-rank RNG file is missing), and the run goes on, not
    bit-identical to the one that saved.
    """
    if not isinstance(saved, bytes):  # read from storage: whatever a writer put there
        raise CorruptCheckpointError(
            f"iteration {iteration} at {url} holds a {type(saved).__name__} as the ranks' RNG states, not "
            "the bytes FsspecTrainer writes; resume from another iteration, or without resume_from_checkpoint"
        )
    size = torch.get_rng_state().numel()
    ranks, rank = (
        (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)
    )
    if len(saved) != ranks * size:
        logger.warning(
            "iteration %d at %s holds RNG states for %d ranks, not %d: each rank keeps its own RNG state",
            iteration,
            url,
            len(saved) // size,
            ranks,
        )
        return
    torch.set_rng_state(
        torch.frombuffer(bytearray(saved[rank * size : (rank + 1) * size]), dtype=torch.uint8)
    )
