"""torchtitan through dcp_fsspec: a tiny model trained a few steps on CPU with torchtitan's own
optimizer and LR-scheduler containers, checkpointed by :class:`FsspecCheckpointManager` (built
from its ``Config``, as torchtitan's trainer builds it) to moto S3 and to a local folder, resumed
by a fresh manager over fresh objects, and its weights, optimizer state, LR schedule and data
position bit-identical to a run that was never interrupted.

Single process here (no process group: torchtitan's synchronous path needs none; its async
modes get a group of this process alone); FSDP2 over a CPU mesh on 2 real gloo ranks, each run
a fresh pair of processes, in the ``slow`` tests, synchronous and async.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import import_or_skip

import_or_skip("torchtitan", "the [torchtitan] extra is not installed: pip install 'dcp-fsspec[torchtitan]'")

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

from dcp_fsspec.errors import CheckpointNotFoundError, StorageError
from dcp_fsspec.integrations.torchtitan import FsspecCheckpointManager
from tests.ckpt_helpers import assert_equal
from tests.conftest import Backend
from tests.distributed import run_ranks

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

STEPS = 6
RESUME = 4


class Batches(Stateful):
    """The data torchtitan checkpoints as ``dataloader``: a seeded stream of random batches."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(7)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(16, 8, generator=self.generator), torch.randn(16, 4, generator=self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.generator.set_state(state_dict["rng"])


class TrainState(Stateful):
    """torchtitan's ``train_state``: the step reached."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class Transposed(nn.Linear):
    """A layer whose state dict holds its weight transposed: a tensor made afresh by a hook at
    every ``state_dict()`` (as a hook splitting a fused weight makes one), not the parameter."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__(inputs, outputs)
        self._register_state_dict_hook(Transposed._transpose_out)
        self._register_load_state_dict_pre_hook(Transposed._transpose_in)

    @staticmethod
    def _transpose_out(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t().contiguous()

    @staticmethod
    def _transpose_in(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()


class Run:
    """One training run: model, torchtitan's containers, and the manager that checkpoints them."""

    def __init__(
        self,
        config: FsspecCheckpointManager.Config | None,
        base_folder: str,
        seed: int = 0,
        last: type[nn.Linear] = nn.Linear,
    ) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), last(16, 4))
        if dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in self.model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizers = OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1}
                )
            ],
            implementation="for-loop",
        ).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=STEPS
        )
        self.batches = Batches()
        self.train_state = TrainState()
        self.manager = (config or FsspecCheckpointManager.Config()).build(
            dataloader=self.batches,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder=base_folder,
        )

    def train(self, until: int) -> None:
        """Train to step ``until``, letting the manager save where its interval says."""
        while self.train_state.step < until:
            x, y = self.batches.next()
            nn.functional.mse_loss(self.model(x), y).backward()
            self.optimizers.step()
            self.optimizers.zero_grad()
            self.lr_schedulers.step()
            self.train_state.step += 1
            self.manager.save(self.train_state.step)
        self.manager.maybe_wait_for_saving()

    def state(self) -> dict[str, Any]:
        """Everything a resume must restore, unsharded (a collective under FSDP)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": get_model_state_dict(self.model, options=options),
            "optim": get_optimizer_state_dict(self.model, self.optimizers.optimizers[0], options=options),
            "lr": self.lr_schedulers.state_dict(),
            "data": self.batches.state_dict(),
            "step": self.train_state.step,
        }


def _config(url: str, options: dict[str, Any], **settings: Any) -> FsspecCheckpointManager.Config:
    return FsspecCheckpointManager.Config(enable=True, folder=url, storage_options=options, **settings)


def _steps_left(backend: Backend) -> list[str]:
    fs = backend.fs
    fs.invalidate_cache()
    return sorted(Path(p).name for p in fs.ls(backend.url, detail=False))


@pytest.fixture(params=["s3", "local"])
def titan_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Backend:
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    # Only the storage options lead to moto: a call made with fsspec's default options (as
    # torchtitan's own helpers make them) goes to a closed port and fails.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    return backend


def test_a_fresh_manager_resumes_bit_identical_and_keeps_the_latest_k(
    titan_backend: Backend, tmp_path: Path
) -> None:
    """Saved every 2 steps with keep_latest_k=2, stopped at step 4; fresh objects and a fresh
    manager resume from step 4 and end where an uninterrupted run ends; only the newest 2 step
    folders are left on the store."""
    uninterrupted = Run(None, str(tmp_path))
    uninterrupted.train(STEPS)
    expected = uninterrupted.state()

    config = _config(titan_backend.url, titan_backend.storage_options, interval=2, keep_latest_k=2)
    first = Run(config, str(tmp_path))
    assert not first.manager.load()  # nothing there yet: a fresh start
    first.train(RESUME)
    first.manager.close()
    assert _steps_left(titan_backend) == ["step-2", "step-4"]

    resumed = Run(config, str(tmp_path), seed=1)  # other initial weights: all must come from storage
    assert resumed.manager.load()
    assert resumed.train_state.step == RESUME
    resumed.train(STEPS)
    resumed.manager.close()
    assert_equal(expected, resumed.state())
    assert _steps_left(titan_backend) == ["step-4", "step-6"]


def test_a_model_whose_state_dict_is_made_afresh_resumes_bit_identical(
    local_backend: Backend, tmp_path: Path
) -> None:
    """DCP loads a hook-made tensor into a copy, not the parameter: the manager puts the loaded
    model entries back into the model (as torchtitan's does), or the resumed run trains on its
    own initial weights."""
    uninterrupted = Run(None, str(tmp_path), last=Transposed)
    uninterrupted.train(STEPS)
    config = _config(local_backend.url, {}, interval=2)
    first = Run(config, str(tmp_path), last=Transposed)
    first.train(RESUME)
    first.manager.close()
    resumed = Run(config, str(tmp_path), seed=1, last=Transposed)
    assert resumed.manager.load()
    resumed.train(STEPS)
    resumed.manager.close()
    assert_equal(uninterrupted.state(), resumed.state())


def test_synchronous_saves_and_loads_plan_with_the_collector_paused(
    local_backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manager's ``dcp.save``/``dcp.load`` run whole with the collector paused (README, "The
    garbage collector"): DCP's planning too, which the writer's and reader's own pauses miss; it
    is on again afterwards. (torchtitan's trainer turns it off itself: then it stays off.)"""
    import gc

    from dcp_fsspec import FsspecStorageReader, FsspecStorageWriter

    seen: list[tuple[str, bool]] = []
    for cls in (FsspecStorageWriter, FsspecStorageReader):
        real = cls.prepare_local_plan

        def recording(self: Any, plan: Any, _real: Any = real) -> Any:
            seen.append((type(self).__name__, gc.isenabled()))
            return _real(self, plan)

        monkeypatch.setattr(cls, "prepare_local_plan", recording)
    config = _config(local_backend.url, {}, interval=2)
    first = Run(config, str(tmp_path))
    first.train(2)
    first.manager.close()
    resumed = Run(config, str(tmp_path), seed=1)
    assert resumed.manager.load()
    resumed.manager.close()
    assert seen == [("FsspecStorageWriter", False), ("FsspecStorageReader", False)]
    assert gc.isenabled()


def test_resuming_skips_a_step_without_metadata_and_a_missing_step_names_its_url(
    local_backend: Backend, tmp_path: Path
) -> None:
    """A step folder whose .metadata never landed (a save cut short) is not resumed from;
    asking for a step that was never saved is an error naming its URL."""
    config = _config(local_backend.url, {}, interval=2, keep_latest_k=0)
    first = Run(config, str(tmp_path))
    first.train(RESUME)
    first.manager.close()
    (Path(local_backend.url) / "step-4" / ".metadata").unlink()

    resumed = Run(config, str(tmp_path), seed=1)
    assert resumed.manager.load()
    assert resumed.train_state.step == 2
    with pytest.raises(CheckpointNotFoundError, match=f"{local_backend.url}/step-3"):
        resumed.manager.load(step=3)
    resumed.manager.close()


def test_an_empty_folder_starts_from_initial_load_path_model_only(
    titan_backend: Backend, tmp_path: Path
) -> None:
    """torchtitan's initial load, through the storage options: the weights of another run's step,
    not its optimizer state; a path without a checkpoint is an error naming it."""
    seed = Run(_config(titan_backend.sub("seed"), titan_backend.storage_options, interval=2), str(tmp_path))
    seed.train(2)
    seed.manager.close()

    def fine_tune(initial: str) -> Run:
        config = _config(titan_backend.sub("tune"), titan_backend.storage_options, initial_load_path=initial)
        return Run(config, str(tmp_path), seed=1)

    tuned = fine_tune(titan_backend.sub("seed", "step-2"))
    assert tuned.manager.load()
    assert not tuned.optimizers.optimizers[0].state and tuned.train_state.step == 0  # (state() makes some)
    assert_equal(seed.state()["model"], tuned.state()["model"])
    tuned.manager.close()
    missing = fine_tune(titan_backend.sub("seed", "step-3"))
    with pytest.raises(CheckpointNotFoundError, match="seed/step-3"):
        missing.manager.load()
    missing.manager.close()


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A process group of this process alone: torchtitan's async modes need one."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg-store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_failed_async_save_is_raised_by_the_next_wait_naming_its_url(
    one_rank: None, local_backend: Backend, tmp_path: Path
) -> None:
    Path(local_backend.url).mkdir(parents=True)
    (Path(local_backend.url) / "step-2").write_bytes(b"a file where the step's folder goes")
    run = Run(_config(local_backend.url, {}, interval=2, async_mode="async"), str(tmp_path))
    with pytest.raises(StorageError, match=f"{local_backend.url}/step-2"):
        run.train(2)  # saves step 2 in a thread, then waits for it
    run.manager.close()


def test_an_async_run_keeps_the_latest_k_counting_the_save_in_flight(
    one_rank: None, titan_backend: Backend, tmp_path: Path
) -> None:
    """Each save is purged for right after it starts, before its folder may be listed: it still
    counts as one of the 2 kept, so an async run ends with 2 folders, as a synchronous one does."""
    config = _config(
        titan_backend.url, titan_backend.storage_options, interval=1, keep_latest_k=2, async_mode="async"
    )
    run = Run(config, str(tmp_path))
    run.train(4)
    run.manager.close()
    assert _steps_left(titan_backend) == ["step-3", "step-4"]


def test_the_config_torchtitan_logs_and_saves_holds_no_secret() -> None:
    config = _config("s3://user:hunter2@bucket/run", {"key": "AKIA-ID", "secret": "hunter3"})
    shown = f"{config!r} {config.to_dict()}"
    assert "hunter2" not in shown and "hunter3" not in shown and "AKIA-ID" not in shown
    assert config.to_dict()["storage_options"].keys() == {"key", "secret"}


def _first(rank: int, world_size: int, url: str, options: dict[str, Any], async_mode: str, out: str) -> None:
    torch.set_num_threads(1)
    uninterrupted = Run(None, out)
    uninterrupted.train(STEPS)
    expected = uninterrupted.state()
    first = Run(_config(url, options, interval=2, keep_latest_k=2, async_mode=async_mode), out)
    first.train(RESUME)
    first.manager.close()
    if rank == 0:
        torch.save(expected, f"{out}/expected.pt")


def _resume(rank: int, world_size: int, url: str, options: dict[str, Any], async_mode: str, out: str) -> None:
    torch.set_num_threads(1)
    resumed = Run(_config(url, options, interval=2, keep_latest_k=2, async_mode=async_mode), out, seed=1)
    assert resumed.manager.load() and resumed.train_state.step == RESUME
    resumed.train(STEPS)
    resumed.manager.close()
    state = resumed.state()
    if rank == 0:
        torch.save(state, f"{out}/resumed.pt")


# The async paths are storage-independent: on local disk only, to keep the suite short.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("titan_backend", "async_mode"),
    [
        ("s3", "disabled"),
        ("local", "disabled"),
        ("local", "async"),
        pytest.param(
            "local",
            "async_with_pinned_mem",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="torchtitan stages this mode with non-blocking copies to pinned memory: CUDA only",
            ),
        ),
    ],
    indirect=["titan_backend"],
)
def test_fsdp2_on_two_ranks_resumes_bit_identical(
    titan_backend: Backend, async_mode: str, tmp_path: Path
) -> None:
    """FSDP2 on 2 gloo ranks: each rank's shards written by our writer (synchronously, in
    torchtitan's thread, or, where CUDA is, in torch's background process), a restarted pair of ranks resumes
    from step 4 and matches 2 ranks that ran all 6 steps; keep_latest_k=2 leaves 2 folders."""
    url, options, out = titan_backend.url, titan_backend.storage_options, str(tmp_path)
    run_ranks(_first, 2, tmp_path, url, options, async_mode, out)
    assert _steps_left(titan_backend) == ["step-2", "step-4"]
    run_ranks(_resume, 2, tmp_path, url, options, async_mode, out)
    assert_equal(
        torch.load(f"{out}/expected.pt", weights_only=True),
        torch.load(f"{out}/resumed.pt", weights_only=True),
    )
    assert _steps_left(titan_backend) == ["step-4", "step-6"]
