"""The Checkpointer across real processes: FSDP2 (gloo, CPU) save, resume, and resharding.

Each phase is a fresh set of spawned ranks, as after a job restart. Phases are few and the
model tiny, since every spawn pays for importing torch.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.multiprocessing as mp

from tests.ckpt_fsdp import Phase, assert_same_full_state, run_phase
from tests.conftest import Backend

pytestmark = pytest.mark.timeout(240)


def _run(backend: Backend, tmp_path: Path, name: str, world_size: int, **kwargs: Any) -> dict[str, Any]:
    phase = Phase(
        url=backend.url,
        storage_options=backend.storage_options,
        world_size=world_size,
        init_file=str(tmp_path / f"init-{name}"),
        out_file=str(tmp_path / f"{name}.pt"),
        **kwargs,
    )
    mp.spawn(run_phase, args=(phase,), nprocs=world_size, join=True)
    return torch.load(phase.out_file, weights_only=False)


def _reference(tmp_path: Path, name: str) -> dict[str, Any]:
    return torch.load(str(tmp_path / f"{name}.pt.ref"), weights_only=False)


@pytest.mark.slow
def test_two_rank_fsdp2_training_resumed_in_fresh_processes_matches_uninterrupted_training(
    shared_backend: Backend, tmp_path: Path
) -> None:
    first = _run(
        shared_backend, tmp_path, "first", 2, expect_resume=0, stop_at=5, save_every=2, reference_steps=8
    )
    assert first["latest"] == "iter_000000004"  # step 5 is lost with the "crash"
    fs, root = fsspec.core.url_to_fs(shared_backend.url, **shared_backend.storage_options)
    fs.invalidate_cache()
    shards = {
        posixpath.basename(p) for p in fs.ls(posixpath.join(root, "iter_000000004", "model"), detail=False)
    }
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= shards  # each rank wrote its own shard

    resumed = _run(shared_backend, tmp_path, "resumed", 2, expect_resume=4, stop_at=8, save_every=2)
    reference = _reference(tmp_path, "first")
    assert_same_full_state(resumed, reference)
    assert resumed["latest"] == "iter_000000008"
    assert resumed["losses"] == {s: reference["losses"][s] for s in (5, 6, 7, 8)}


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_on_a_different_world_size(s3_backend: Backend, tmp_path: Path) -> None:
    _run(s3_backend, tmp_path, "two", 2, expect_resume=0, stop_at=3, save_every=3, reference_steps=9)
    one = _run(s3_backend, tmp_path, "one", 1, expect_resume=3, stop_at=6, save_every=3)
    two_again = _run(s3_backend, tmp_path, "two-again", 2, expect_resume=6, stop_at=9, save_every=3)
    reference = _reference(tmp_path, "two")
    assert one["losses"] == {s: reference["losses"][s] for s in (4, 5, 6)}  # saved by 2 ranks, resumed by 1
    assert two_again["losses"] == {s: reference["losses"][s] for s in (7, 8, 9)}  # saved by 1, resumed by 2
    assert_same_full_state(two_again, reference)
