"""DTensor resharding through our storage classes on real gloo ranks (CPU).

Mirrors torch 2.13's ``test_dtensor_resharding.py`` (``TestDTensorReshardPlacementChange``:
1-D and 2-D placement changes; ``TestDTensorReshardMeshChange``: 1-D ↔ 2-D meshes), which
upstream runs on GPUs only, with ``FsspecStorageWriter``/``FsspecStorageReader`` in place of
``FileSystemWriter``/``FileSystemReader``, and once more with zstd compression (a compressed
record shared by several read items is fetched and decompressed whole). See NOTES.md.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

from dcp_fsspec import FsspecStorageReader, FsspecStorageWriter, WriterSettings
from tests.distributed import run_ranks

ONE_D = [[Shard(0)], [Replicate()], [Shard(1)]]
TWO_D = [
    [Replicate(), Replicate()],
    [Replicate(), Shard(0)],
    [Shard(0), Replicate()],
    [Shard(0), Shard(0)],
    [Shard(1), Shard(0)],
]


def _reshard_everything(rank: int, world_size: int, root: str, writer_options: dict[str, Any]) -> None:
    mesh_1d = init_device_mesh("cpu", (world_size,))
    mesh_2d = init_device_mesh("cpu", (2, world_size // 2))
    full = torch.arange(64, dtype=torch.float32).view(8, 8)
    cases = [
        *((mesh_1d, a, mesh_1d, b) for a, b in itertools.permutations(ONE_D, 2)),
        *((mesh_2d, a, mesh_2d, b) for a, b in itertools.permutations(TWO_D, 2)),
        *((mesh_1d, a, mesh_2d, b) for a, b in itertools.product(ONE_D, TWO_D)),
        *((mesh_2d, a, mesh_1d, b) for a, b in itertools.product(TWO_D, ONE_D)),
    ]
    for n, (save_mesh, saved_as, load_mesh, loaded_as) in enumerate(cases):
        url = f"{root}/case{n}"
        dcp.save(
            {"t": distribute_tensor(full, save_mesh, saved_as)},
            storage_writer=FsspecStorageWriter(url, **writer_options),
        )
        state = {"t": zeros([8, 8], device_mesh=load_mesh, placements=loaded_as)}
        dcp.load(state, storage_reader=FsspecStorageReader(url))
        whole = state["t"].redistribute(load_mesh, [Replicate()] * load_mesh.ndim).to_local()
        assert torch.equal(whole, full), (
            f"{saved_as} on {tuple(save_mesh.shape)} -> {loaded_as} on {tuple(load_mesh.shape)}"
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "writer_options",
    [
        pytest.param({}, id="plain"),
        pytest.param(
            {"settings": WriterSettings(compression="zstd")},
            id="zstd",
            marks=pytest.mark.skipif(
                not ZStandard.is_available(),
                reason="zstandard is not installed: pip install 'dcp-fsspec[zstd]'",
            ),
        ),
    ],
)
def test_dtensors_reshard_across_placements_and_meshes_on_four_ranks(
    tmp_path: Path, writer_options: dict[str, Any]
) -> None:
    run_ranks(_reshard_everything, 4, tmp_path, str(tmp_path / "ckpt"), writer_options)
