"""Lightning Fabric through dcp_fsspec: a tiny model trained a few steps on CPU, saved with
``fabric.save`` to a URL (moto S3, a local folder), loaded by a fresh Fabric with ``fabric.load``,
trained on, and its weights and optimizer state bit-identical to a run that was never interrupted.

Single-file checkpoints (Fabric given ``FsspecCheckpointIO``) run in this process. Sharded
checkpoints (``FsspecFabricModelParallelStrategy``: FSDP2 over a CPU mesh) run on 2 real gloo
ranks, each a fresh process, so the loading run is also a restarted one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import import_or_skip

import_or_skip("lightning", "the [lightning] extra is not installed: pip install -e '.[test]'")

from lightning.fabric import Fabric

from dcp_fsspec.errors import CheckpointMismatchError, CheckpointNotFoundError, UsageError
from dcp_fsspec.integrations.lightning import FsspecCheckpointIO, FsspecFabricModelParallelStrategy
from tests.ckpt_helpers import assert_equal
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.integrations.test_lightning import RESUME, STEPS, _data, lightning_backend  # noqa: E402, F401

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _setup(fabric: Fabric, seed: int) -> tuple[Any, Any]:
    """The tiny model and its optimizer; a loading run starts from another seed and learning rate,
    so only a load of the weights, the optimizer's state and its param_groups can make it match."""
    model = fabric.setup_module(_net(seed))
    return model, fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=0.05 if seed == 0 else 0.01)
    )


def _train(fabric: Fabric, model: Any, optimizer: Any, steps: int) -> None:
    x, y = next(iter(_data()))
    for _ in range(steps):
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    """Full (unsharded) weights and optimizer state, comparable across runs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optim = get_state_dict(model.module, optimizer.optimizer, options=options)
    return {"model": weights, "optim": optim}


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_fabric_with_checkpoint_io_resumes_bit_identical(lightning_backend: Backend, async_mode: str) -> None:
    """Fabric(plugins=[FsspecCheckpointIO]) saves one file to the URL; a fresh Fabric loads it into
    a differently initialised model, trains on, and ends where an uninterrupted run ends."""
    plain = Fabric(accelerator="cpu", devices=1)
    model, optimizer = _setup(plain, seed=0)
    _train(plain, model, optimizer, STEPS)
    expected = _state(model, optimizer)

    url = lightning_backend.sub(f"step={RESUME}.ckpt")
    io = FsspecCheckpointIO(lightning_backend.storage_options, async_mode=async_mode)
    first = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, optimizer = _setup(first, seed=0)
    _train(first, model, optimizer, RESUME)
    first.save(url, {"model": model, "optimizer": optimizer, "step": RESUME})
    first.strategy.teardown()  # Fabric never does: waits for the upload, raises its error

    second = Fabric(
        accelerator="cpu", devices=1, plugins=[FsspecCheckpointIO(lightning_backend.storage_options)]
    )
    model, optimizer = _setup(second, seed=1)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert second.load(url, state) == {}
    assert state["step"] == RESUME
    _train(second, model, optimizer, STEPS - RESUME)
    assert_equal(expected, _state(model, optimizer))


def test_sharded_strategy_refuses_single_file_checkpoints() -> None:
    with pytest.raises(UsageError, match="save_distributed_checkpoint"):
        FsspecFabricModelParallelStrategy(_shard, save_distributed_checkpoint=False)


def test_loading_a_missing_sharded_checkpoint_names_the_url(lightning_backend: Backend) -> None:
    url = lightning_backend.sub("nothing")
    strategy = FsspecFabricModelParallelStrategy(_shard, storage_options=lightning_backend.storage_options)
    with pytest.raises(CheckpointNotFoundError, match=url.split("://")[-1]):
        strategy.load_checkpoint(url, {"model": _net(0)})


def _sharded_run(rank: int, world_size: int, url: str, options: dict[str, Any], phase: str, out: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_PORT="1")  # already initialized by run_ranks; Lightning only reads it
    kind, async_mode = phase.split("-")
    strategy = FsspecFabricModelParallelStrategy(
        _shard,
        data_parallel_size=world_size,
        tensor_parallel_size=1,
        storage_options=options,
        async_mode=async_mode,
    )
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model, optimizer = _setup(fabric, seed=1 if kind == "resume" else 0)
    checkpoint = f"{url}/step={RESUME}"
    if kind == "resume":
        with pytest.raises(CheckpointMismatchError, match=checkpoint.split("://")[-1]):
            fabric.load(checkpoint, {"model": model, "optimizer": optimizer, "absent": 0})
        state = {"model": model, "optimizer": optimizer, "step": 0}
        assert fabric.load(checkpoint, state) == {"note": "kept"}
        assert state["step"] == RESUME
    _train(
        fabric, model, optimizer, RESUME if kind == "first" else STEPS - RESUME if kind == "resume" else STEPS
    )
    if kind == "first":
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": RESUME, "note": "kept"})
        _train(
            fabric, model, optimizer, 1
        )  # an async save's shards were copied: training on cannot change them
        strategy.wait()
    state = _state(model, optimizer)
    if rank == 0:
        torch.save(state, f"{out}/{phase}.pt")


# The async path is storage-independent: on local disk only, to keep the suite short.
@pytest.mark.parametrize(
    ("lightning_backend", "async_mode"),
    [("s3", "disabled"), ("local", "disabled"), ("local", "async")],
    indirect=["lightning_backend"],
)
@pytest.mark.slow
def test_sharded_checkpoint_on_two_ranks_resumes_bit_identical(
    lightning_backend: Backend, async_mode: str, tmp_path: Path
) -> None:
    """FSDP2 on 2 gloo ranks: fabric.save writes the shards through our writer to the URL, a
    restarted pair of ranks loads them into differently initialised models, trains on, and
    matches 2 ranks that never stopped; a strict load of an entry the checkpoint lacks fails."""
    out = str(tmp_path)
    url, options = lightning_backend.url, lightning_backend.storage_options
    run_ranks(_sharded_run, 2, tmp_path, url, options, f"plain-{async_mode}", out)
    run_ranks(_sharded_run, 2, tmp_path, url, options, f"first-{async_mode}", out)
    fs = lightning_backend.fs
    assert fs.exists(f"{url}/step={RESUME}/.metadata") and fs.exists(f"{url}/step={RESUME}/meta.pt")
    run_ranks(_sharded_run, 2, tmp_path, url, options, f"resume-{async_mode}", out)
    expected = torch.load(f"{out}/plain-{async_mode}.pt", weights_only=True)
    assert_equal(expected, torch.load(f"{out}/resume-{async_mode}.pt", weights_only=True))
