"""Several real ranks: DTensor state saved by 2 ranks, resharded on load, replicas written once."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_fsspec import FsspecStorageReader, FsspecStorageWriter
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.helpers import load


def full_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "sharded": torch.randn(16, 12, generator=gen),
        "replicated": torch.randn(300, generator=gen),
        "plain": torch.arange(6),
    }


def _save_sharded_rows(rank: int, world_size: int, url: str, options: dict[str, Any]) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    full = full_state()
    state = {
        "sharded": distribute_tensor(full["sharded"], mesh, [Shard(0)]),
        "replicated": distribute_tensor(full["replicated"], mesh, [Replicate()]),
        "plain": full["plain"],
    }
    dcp.save(state, storage_writer=FsspecStorageWriter(url, storage_options=options))


def _load_sharded_columns(rank: int, world_size: int, url: str, options: dict[str, Any]) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    full = full_state()
    state = {
        "sharded": distribute_tensor(torch.zeros(16, 12), mesh, [Shard(1)]),
        "replicated": distribute_tensor(torch.zeros(300), mesh, [Replicate()]),
        "plain": torch.zeros(6, dtype=torch.int64),
    }
    dcp.load(state, storage_reader=FsspecStorageReader(url, storage_options=options))
    width = 12 // world_size
    assert torch.equal(state["sharded"].to_local(), full["sharded"][:, rank * width : (rank + 1) * width])
    assert torch.equal(state["replicated"].to_local(), full["replicated"])
    assert torch.equal(state["plain"], full["plain"])


def test_two_ranks_save_and_one_rank_loads_full_tensors(shared_backend: Backend, tmp_path: Path) -> None:
    run_ranks(_save_sharded_rows, 2, tmp_path, shared_backend.url, shared_backend.storage_options)
    fs, root = shared_backend.fs, shared_backend.fs._strip_protocol(shared_backend.url)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert any(n.startswith("__0_") for n in names) and any(n.startswith("__1_") for n in names)

    metadata = pickle.loads(fs.cat_file(f"{root}/.metadata"))
    stored = [index.fqn for index in metadata.storage_data]
    # Replicated tensors and identical plain tensors are written once, by the lowest rank.
    assert stored.count("replicated") == 1 and stored.count("plain") == 1
    assert stored.count("sharded") == 2

    full = full_state()
    loaded = load({k: torch.zeros_like(v) for k, v in full.items()}, shared_backend)
    for key, value in full.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.slow
def test_two_ranks_load_with_a_different_sharding(shared_backend: Backend, tmp_path: Path) -> None:
    run_ranks(_save_sharded_rows, 2, tmp_path, shared_backend.url, shared_backend.storage_options)
    run_ranks(_load_sharded_columns, 2, tmp_path, shared_backend.url, shared_backend.storage_options)
