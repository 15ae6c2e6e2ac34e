"""The safetensors export and import on several gloo ranks: FSDP2 → safetensors on S3 → FSDP2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from dcp_fsspec import Checkpointer
from dcp_fsspec.storage.read.safetensors_reader import SafetensorsStorageReader
from dcp_fsspec.storage.write.writer import FsspecStorageWriter
from dcp_fsspec.tools.safetensors.export import INDEX_NAME, export_safetensors
from tests.conftest import Backend
from tests.distributed import run_ranks

safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.slow


def _fsdp_model(world_size: int, seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _save_and_export(rank: int, world_size: int, url: str, opts: dict[str, Any], out: str, dump: str) -> None:
    model = _fsdp_model(world_size, seed=0)
    with Checkpointer(url, opts) as ckpt:
        ckpt.save(1, model=model)
    full = _full_state(model)
    if rank == 0:
        torch.save(full, dump)
    # A 100 KB shard and a 16 KB buffer: several shards for each rank, the 256 KB weight in pieces.
    result = export_safetensors(
        url, out, opts, opts, max_shard_size=100_000, buffer_bytes=16_384, process_group=dist.group.WORLD
    )
    assert len(result.shards) == 3 and result.tensors == 6, result  # every rank reports the whole export


def _load_into_fsdp(rank: int, world_size: int, out: str, opts: dict[str, Any], dump: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    model = _fsdp_model(world_size, seed=1)  # other weights: all of them must come from the folder
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=SafetensorsStorageReader(out, opts))
    set_model_state_dict(model, state)
    full = _full_state(model)
    if rank == 0:
        expected = torch.load(dump)
        assert sorted(full) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(full[name], tensor), name
    sys.stdout.flush()


def test_fsdp2_on_two_ranks_exports_together_to_s3_and_loads_back_bit_exact_on_two_ranks_and_on_one(
    tmp_path: Path, s3_backend: Backend
) -> None:
    url, out, opts = s3_backend.sub("run"), s3_backend.sub("hf"), s3_backend.storage_options
    dump = str(tmp_path / "full.pt")
    run_ranks(_save_and_export, 2, tmp_path, url, opts, out, dump)
    expected = torch.load(dump)
    fs = s3_backend.fs
    assert fs.exists(f"{out}/{INDEX_NAME}")
    loaded: dict[str, torch.Tensor] = {}
    for path in sorted(fs.glob(f"{out}/model-*.safetensors")):
        loaded.update(safetensors_torch.load(fs.cat_file(path)))
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    run_ranks(_load_into_fsdp, 2, tmp_path, out, opts, dump)
    run_ranks(_load_into_fsdp, 1, tmp_path, out, opts, dump)


def _export_failing_on_rank_1(rank: int, world_size: int, src: str, out: str) -> None:
    from dcp_fsspec.errors import UsageError

    # One tensor a shard: rank 0 writes "a" and "c", rank 1 "b", which float16 cannot hold.
    with pytest.raises(UsageError, match=out) as raised:
        export_safetensors(src, out, max_shard_size=1, dtype=torch.float16, process_group=dist.group.WORLD)
    assert "'b'" in str(raised.value)


def test_a_failure_on_one_rank_raises_on_every_rank_and_removes_the_shards_every_rank_wrote(
    tmp_path: Path,
) -> None:
    src = str(tmp_path / "ckpt")
    dcp.save(
        {"a": torch.ones(8), "b": torch.full((8,), 1e6), "c": torch.zeros(8)},
        storage_writer=FsspecStorageWriter(src),
    )
    out = tmp_path / "hf"
    run_ranks(_export_failing_on_rank_1, 2, tmp_path, src, str(out))
    assert not out.exists()


def _save_columns(rank: int, world_size: int, src: str, expected: dict[str, torch.Tensor]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {
        "cols": distribute_tensor(expected["cols"], mesh, [Shard(1)]),
        "rows": distribute_tensor(expected["rows"], mesh, [Shard(0)]),
    }
    dcp.save(state, storage_writer=FsspecStorageWriter(src))


def test_a_column_sharded_tensor_bigger_than_the_buffer_is_exported_in_pieces_equal_to_the_whole(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    expected = {"cols": torch.randn(96, 40), "rows": torch.randn(50, 3, 7).to(torch.bfloat16)}
    src = str(tmp_path / "ckpt")
    run_ranks(_save_columns, 2, tmp_path, src, expected)
    out = tmp_path / "hf"
    export_safetensors(src, out, buffer_bytes=1000, dtype=torch.float16)
    loaded = safetensors_torch.load_file(str(out / "model-00001-of-00001.safetensors"))
    assert torch.equal(loaded["cols"], expected["cols"].to(torch.float16))
    assert torch.equal(loaded["rows"], expected["rows"].to(torch.float16))
