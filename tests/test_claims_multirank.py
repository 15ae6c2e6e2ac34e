"""README claims about saves of several ranks that had no multi-rank test: ``verify_before_commit``
reads back every rank's files before the commit, and refuses the iteration on every rank when one
rank's bytes were damaged after they were written; ``process_group=`` is the group a checkpoint
spans. Real gloo process groups (``tests/distributed.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dcp_fsspec import Checkpointer, CorruptCheckpointError
from dcp_fsspec.checkpoint.commit.commit_record import read_commit_record
from dcp_fsspec.storage.transport.urls import resolve
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.helpers import flip_a_byte_of_each_data_file_once_written

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(rank: int, iteration: int) -> dict[str, Any]:
    # Names differ per rank, so each rank writes data files of its own.
    return {f"rank{rank}": torch.full((1024,), float(iteration))}


def _verify_two_ranks(rank: int, world_size: int, url: str) -> None:
    with Checkpointer(url, verify_before_commit=True) as ckpt:
        ckpt.save(1, state=_state(rank, 1))
        assert ckpt.latest_checkpoint() == "iter_000000001"
        with pytest.MonkeyPatch.context() as patch:
            if rank == 1:  # only rank 1's file is damaged; rank 0 verifies and both learn it
                flip_a_byte_of_each_data_file_once_written(patch)
            with pytest.raises(CorruptCheckpointError) as info:
                ckpt.save(2, state=_state(rank, 2))
        assert "iter_000000002" in str(info.value), str(info.value)
        assert ckpt.latest_checkpoint() == "iter_000000001" and ckpt.committed_iterations() == [1]


def test_verify_before_commit_with_two_ranks_refuses_an_iteration_one_rank_damaged_on_both(
    local_backend: Backend, tmp_path: Path
) -> None:
    run_ranks(_verify_two_ranks, 2, tmp_path, local_backend.url)


def _save_on_a_subgroup(rank: int, world_size: int, url: str) -> None:
    group = dist.new_group(ranks=[0, 1], backend="gloo")  # every rank must take part in creating it
    if rank == 2:
        return  # not in the group: it takes no part in the checkpoint
    with Checkpointer(url, process_group=group) as ckpt:
        ckpt.save(1, state=_state(rank, 1))
        back = {f"rank{rank}": torch.zeros(1024)}
        assert ckpt.load(state=back) == 1
    assert torch.equal(back[f"rank{rank}"], torch.full((1024,), 1.0))
    record = read_commit_record(resolve(url), 1)
    assert record is not None and record.world_size == 2


def test_a_checkpointer_given_a_process_group_spans_only_its_ranks(
    local_backend: Backend, tmp_path: Path
) -> None:
    """Checkpointer(process_group=...): "the group the checkpoint spans"; a rank outside it is not waited for."""
    run_ranks(_save_on_a_subgroup, 3, tmp_path, local_backend.url)
