"""torch_checkpointing's ``CheckpointManager`` with FSDP2 on 2 gloo ranks, through FsspecStorage on S3.

Each rank saves its shards of an FSDP2 model and its AdamW state, then loads them into a fresh
model with other weights. The full (unsharded) state after the load matches the saved one bit
for bit, with the rename commit and with the marker commit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import import_or_skip

import_or_skip(
    "torch_checkpointing",
    "the [torch-checkpointing] extra is not installed: pip install 'dcp-fsspec[torch-checkpointing]'",
)

from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch_checkpointing import CheckpointManager

from dcp_fsspec.integrations.torch_checkpointing import FsspecStorage, FsspecStorageConfig, commit_by_marker
from tests.ckpt_fsdp import FsdpTraining
from tests.ckpt_helpers import assert_equal
from tests.conftest import Backend
from tests.distributed import run_ranks


def _sharded(training: FsdpTraining) -> dict[str, Any]:
    """What torchtitan hands the manager: each rank's DTensor shards of the model and optimizer."""
    return {
        "model": get_model_state_dict(training.model),
        "optim": get_optimizer_state_dict(training.model, training.optim),
    }


def _save_and_load(
    rank: int, world_size: int, url: str, storage_options: dict[str, Any], marker: bool
) -> None:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = FsspecStorageConfig(url=url, storage_options=storage_options, part_size=4096)
    manager = (commit_by_marker(config) if marker else config).build()
    try:
        saved = FsdpTraining(mesh, seed=3)
        for _ in range(2):
            saved.step()
        manager.save("step_2", _sharded(saved))
        fresh = FsdpTraining(mesh, seed=4)  # other weights: everything must come from storage
        fresh.step()
        into = _sharded(fresh)
        loaded = manager.load("step_2", into=into)
    finally:
        manager.close()
    set_model_state_dict(fresh.model, loaded["model"])
    set_optimizer_state_dict(fresh.model, fresh.optim, loaded["optim"])
    want, got = saved.full_state(), fresh.full_state()  # collectives: every rank calls them
    if rank == 0:
        assert_equal(got["model"], want["model"], "model")
        assert_equal(got["optim"], want["optim"], "optim")


@pytest.mark.slow
@pytest.mark.parametrize("marker", [False, True], ids=["rename", "marker"])
def test_an_fsdp2_model_and_optimizer_saved_on_two_ranks_load_bit_exact_into_a_fresh_model(
    s3_backend: Backend, tmp_path: Path, marker: bool
) -> None:
    run_ranks(_save_and_load, 2, tmp_path, s3_backend.url, s3_backend.storage_options, marker)
    storage = FsspecStorage(
        FsspecStorageConfig(url=s3_backend.url, storage_options=s3_backend.storage_options)
    )
    assert storage.ls(Path("")) == ["step_2"]
    assert storage.is_committed(Path("step_2")) == marker
