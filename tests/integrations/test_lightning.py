"""Lightning through dcp_fsspec: a tiny model trained a few steps on CPU, checkpointed to a URL
(moto S3, a local folder) by the integration, resumed by a fresh Trainer from ``ckpt_path``, and
its weights and optimizer state bit-identical to a run that was never interrupted.

Single-file checkpoints (``FsspecCheckpointIO``, sync and wrapped in ``AsyncCheckpointIO``) run
in this process. Sharded checkpoints (``FsspecModelParallelStrategy``: FSDP2 over a CPU mesh)
run on 2 real gloo ranks, each a fresh process, so the resuming run is also a restarted one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import import_or_skip

import_or_skip("lightning", "the [lightning] extra is not installed: pip install -e '.[test]'")

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from dcp_fsspec.errors import CheckpointNotFoundError
from dcp_fsspec.integrations.lightning import FsspecCheckpointIO, FsspecModelParallelStrategy
from tests.ckpt_helpers import assert_equal
from tests.conftest import Backend
from tests.distributed import run_ranks

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# One batch an epoch, a checkpoint at each epoch's end: Lightning 2.6 resumes an epoch-end checkpoint
# by finishing that epoch with the first batch of a fresh iterator, which only a one-batch epoch
# makes the same batch an uninterrupted run sees next.
STEPS = 8
RESUME = 4


class Tiny(LightningModule):
    def __init__(self, shard: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.shard = shard

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _data() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 8, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=False)


def _trainer(max_steps: int, **kwargs: Any) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _state(model: Tiny, trainer: Trainer) -> dict[str, Any]:
    """Full (unsharded) weights and optimizer state, comparable across runs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optim = get_state_dict(model, trainer.optimizers, options=options)
    return {"model": weights, "optim": optim}


def _kept(backend: Backend) -> list[str]:
    """What save_top_k=2 leaves: the newest two, and on local disk the one resumed from too
    (ModelCheckpoint never deletes a local checkpoint the Trainer resumed from)."""
    resumed = [f"step={RESUME}.ckpt"] if backend.name == "local" else []
    return sorted([*resumed, f"step={STEPS - 1}.ckpt", f"step={STEPS}.ckpt"])


def _uninterrupted(**kwargs: Any) -> dict[str, Any]:
    model = Tiny()
    trainer = _trainer(STEPS, **kwargs)
    trainer.fit(model, _data())
    return _state(model, trainer)


@pytest.fixture(params=["s3", "local"])
def lightning_backend(request: pytest.FixtureRequest) -> Backend:
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    return backend


@pytest.mark.parametrize("mode", ["disabled", "async", "AsyncCheckpointIO"])
def test_single_file_checkpoint_resumes_bit_identical_and_keeps_top_k(
    lightning_backend: Backend, mode: str, tmp_path: Path
) -> None:
    """ModelCheckpoint(dirpath=URL, save_top_k=2) writes through FsspecCheckpointIO (sync, async,
    or inside Lightning's AsyncCheckpointIO); a fresh Trainer resumes from the step-4 file and
    ends where an uninterrupted run ends, and only the 2 newest files are left."""
    expected = _uninterrupted(default_root_dir=str(tmp_path))

    def plugin() -> Any:
        if mode == "AsyncCheckpointIO":
            return AsyncCheckpointIO(FsspecCheckpointIO(lightning_backend.storage_options))
        return FsspecCheckpointIO(lightning_backend.storage_options, async_mode=mode)

    def checkpoints() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=lightning_backend.url,
            filename="{step}",
            save_on_train_epoch_end=True,
            save_top_k=2,
            monitor="step",
            mode="max",
        )

    first = _trainer(RESUME, plugins=[plugin()], callbacks=[checkpoints()], default_root_dir=str(tmp_path))
    first.fit(Tiny(), _data())
    resumed_from = lightning_backend.sub(f"step={RESUME}.ckpt")
    assert lightning_backend.fs.exists(resumed_from)

    model = Tiny()
    second = _trainer(STEPS, plugins=[plugin()], callbacks=[checkpoints()], default_root_dir=str(tmp_path))
    second.fit(model, _data(), ckpt_path=resumed_from)
    assert_equal(expected, _state(model, second))
    if mode == "AsyncCheckpointIO":
        return  # Lightning's wrapper removes a file without waiting for its save: it may stay
    lightning_backend.fs.invalidate_cache()
    left = sorted(Path(p).name for p in lightning_backend.fs.ls(lightning_backend.url, detail=False))
    assert left == _kept(lightning_backend)


def test_an_async_save_then_its_removal_leaves_nothing(lightning_backend: Backend) -> None:
    """save_top_k removes a file right after saving a newer one: with async_mode="async" the
    removal waits for that file's upload, so it cannot land after the removal and stay."""
    io = FsspecCheckpointIO(lightning_backend.storage_options, async_mode="async")
    url = lightning_backend.sub("step=1.ckpt")
    io.save_checkpoint({"weights": torch.zeros(16 * 1024 * 1024)}, url)  # 64 MiB: the upload takes a while
    io.remove_checkpoint(url)
    io.teardown()
    lightning_backend.fs.invalidate_cache()
    assert not lightning_backend.fs.exists(url)


def test_loading_a_missing_file_names_the_url(lightning_backend: Backend) -> None:
    url = lightning_backend.sub("nothing.ckpt")
    with pytest.raises(CheckpointNotFoundError, match=url.split("://")[-1]):
        FsspecCheckpointIO(lightning_backend.storage_options).load_checkpoint(url)


def _sharded_run(rank: int, world_size: int, url: str, options: dict[str, Any], phase: str, out: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_PORT="1")  # already initialized by run_ranks; Lightning only reads it
    model = Tiny(shard=True)
    checkpoints = ModelCheckpoint(
        dirpath=url, filename="{step}", save_on_train_epoch_end=True, save_top_k=2, monitor="step", mode="max"
    )
    strategy = FsspecModelParallelStrategy(storage_options=options, async_mode=phase.split("-")[1])
    trainer = _trainer(
        RESUME if phase.startswith("first") else STEPS,
        strategy=strategy,
        devices=world_size,
        callbacks=[checkpoints] if url else [],
        enable_checkpointing=bool(url),
        default_root_dir=out,
    )
    ckpt_path = f"{url}/step={RESUME}.ckpt" if phase.startswith("resume") else None
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    state = _state(model, trainer)
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
    """FSDP2 on 2 gloo ranks: shards written by our writer to the URL, a restarted pair of ranks
    resumes from step 3 and matches 2 ranks that ran all 6 steps; save_top_k=2 leaves 2 folders."""
    out = str(tmp_path)
    url, options = lightning_backend.url, lightning_backend.storage_options
    run_ranks(_sharded_run, 2, tmp_path, "", {}, f"plain-{async_mode}", out)
    run_ranks(_sharded_run, 2, tmp_path, url, options, f"first-{async_mode}", out)
    fs = lightning_backend.fs
    assert fs.exists(f"{url}/step={RESUME}.ckpt/.metadata") and fs.exists(f"{url}/step={RESUME}.ckpt/meta.pt")
    run_ranks(_sharded_run, 2, tmp_path, url, options, f"resume-{async_mode}", out)
    expected = torch.load(f"{out}/plain-{async_mode}.pt", weights_only=True)
    assert_equal(expected, torch.load(f"{out}/resume-{async_mode}.pt", weights_only=True))
    fs.invalidate_cache()
    assert sorted(Path(p).name for p in fs.ls(url, detail=False)) == _kept(lightning_backend)
