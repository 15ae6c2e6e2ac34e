"""The Hugging Face Trainer through dcp_fsspec on two processes: DDP over a real gloo group on
CPU, the tiny GPT-2 of ``test_hf.py`` trained a few steps, checkpointed by ``FsspecTrainer`` to
moto S3, the pair of processes stopped, a fresh pair resumed from the iteration's URL, and each
rank's weights, optimizer, scheduler and torch RNG state bit-identical to a pair that was never
interrupted; ``save_total_limit`` leaves only the newest iterations on S3.

Each rank draws from torch's RNG a number of times of its own after every step (as
augmentation, or dropout over batches of different lengths, would), so the ranks' RNG states
differ, and a resume must give each rank its own back.

The Trainer joins the group ``tests/distributed.py`` started: with ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK`` set and ``use_cpu=True``, accelerate's ``PartialState`` sees a multi-CPU run and
keeps the initialised gloo group, and the Trainer wraps the model in DDP.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tests.conftest import import_or_skip

import_or_skip("transformers", "the [hf] extra is not installed: pip install -e '.[test]'")

import torch.distributed as dist
from transformers import TrainerCallback

from dcp_fsspec.errors import CorruptCheckpointError
from dcp_fsspec.integrations.hf import _restore_rng_state
from tests.ckpt_helpers import assert_equal
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.integrations.test_hf import STEPS, STOP, _state, _StopAt, _trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


class _RankNoise(TrainerCallback):
    """Draws ``rank + 1`` numbers from torch's RNG after every step: the ranks' states part."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        torch.rand(dist.get_rank() + 1)
        return control


def _run(rank: int, world_size: int, url: str, options: dict[str, Any], phase: str, out: str) -> None:
    """One rank of one phase: ``plain`` (no checkpoints), ``first`` (stops at ``STOP``) or
    ``resumed`` (from ``STOP``'s iteration); writes its final state to ``out/{phase}-{rank}.pt``."""
    # MASTER_PORT is only read: the group is already initialised (accelerate keeps it).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_PORT="1")
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    backend = Backend("s3", url, options) if url else None
    callbacks = [_RankNoise(), *([_StopAt()] if phase == "first" else [])]
    trainer = _trainer(Path(out) / f"{phase}-{rank}", backend, *callbacks)
    assert trainer.args.world_size == world_size and dist.get_world_size() == world_size
    if phase == "plain":
        trainer.args.save_strategy = "no"
        trainer.train()
    elif phase == "first":
        trainer.train()
        assert trainer.state.global_step == STOP
    else:
        trainer.train(resume_from_checkpoint=f"{url}/iter_{STOP:09d}")
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel"
    torch.save({**_state(trainer), "rng": torch.get_rng_state()}, f"{out}/{phase}-{rank}.pt")
    trainer.checkpointer.finalize()


@pytest.mark.slow
def test_two_processes_resume_from_s3_bit_identical_and_keep_save_total_limit(
    s3_backend: Backend, tmp_path: Path
) -> None:
    out, url, options = str(tmp_path), s3_backend.url, s3_backend.storage_options
    run_ranks(_run, 2, tmp_path, "", {}, "plain", out)
    plain = [torch.load(f"{out}/plain-{rank}.pt", weights_only=True) for rank in range(2)]
    assert not torch.equal(plain[0]["rng"], plain[1]["rng"]), "the ranks' RNG states should differ"
    run_ranks(_run, 2, tmp_path, url, options, "first", out)
    fs = s3_backend.fs
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False) if "/iter_" in p) == [
        f"iter_{s:09d}" for s in (STOP - 2, STOP)
    ]
    run_ranks(_run, 2, tmp_path, url, options, "resumed", out)
    for rank in range(2):
        assert_equal(plain[rank], torch.load(f"{out}/resumed-{rank}.pt", weights_only=True))
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False) if "/iter_" in p) == [
        f"iter_{s:09d}" for s in (STEPS - 2, STEPS)
    ]


def test_rng_states_saved_by_another_number_of_ranks_leave_this_ranks_own_and_name_the_url(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A resume on another number of processes than the save's: no state is this rank's."""
    own = torch.get_rng_state()
    two_ranks = (
        torch.cat([torch.manual_seed(1).get_state(), torch.manual_seed(2).get_state()]).numpy().tobytes()
    )
    torch.set_rng_state(own)
    with caplog.at_level(logging.WARNING, logger="dcp_fsspec.integrations.hf"):
        _restore_rng_state(two_ranks, "s3://bucket/run", 4)
    assert torch.equal(torch.get_rng_state(), own)
    assert "s3://bucket/run" in caplog.text and "2 ranks, not 1" in caplog.text


def test_rng_states_of_another_type_are_refused_naming_the_url() -> None:
    with pytest.raises(CorruptCheckpointError, match="s3://bucket/run"):
        _restore_rng_state(
            cast(bytes, torch.get_rng_state()), "s3://bucket/run", 4
        )  # a tensor, as once saved
