"""A training process for the multi-rank checkpointer tests: FSDP2 on CPU over gloo.

``run_phase`` is what each spawned rank runs: join the process group, build an FSDP2-sharded
MLP with AdamW and an LR schedule, resume through :class:`Checkpointer`, train to a step while
saving every few steps, and (rank 0) dump the full, unsharded state for the test to compare.
Every rank draws the same batch, so the arithmetic is the same at any world size (gradients are
averaged over identical copies) and runs with different world sizes compare bit for bit.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcp_fsspec import Checkpointer
from tests.ckpt_helpers import assert_equal


@dataclass
class Phase:
    """One run of training processes: where to checkpoint, what to expect, when to stop."""

    url: str
    storage_options: dict[str, Any]
    world_size: int
    init_file: str
    out_file: str
    expect_resume: int
    stop_at: int
    save_every: int
    seed: int = 0
    reference_steps: int = 0  # > 0: first train this far without checkpoints, dump to out_file + ".ref"
    async_mode: str = "disabled"


class FsdpTraining:
    def __init__(self, mesh: Any, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
        )
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optim, step_size=3, gamma=0.5)
        self.data = torch.Generator().manual_seed(seed + 100)
        self.trainer: dict[str, Any] = {"step": 0, "data_rng": self.data.get_state()}
        self.losses: dict[int, float] = {}

    def keys(self) -> dict[str, Any]:
        self.trainer["data_rng"] = self.data.get_state()
        return {
            "model": self.model,
            "optim": self.optim,
            "scheduler": self.scheduler,
            "trainer": self.trainer,
        }

    def after_load(self) -> None:
        self.data.set_state(self.trainer["data_rng"])

    def step(self) -> None:
        x = torch.randn(16, 8, generator=self.data)
        y = torch.randn(16, 4, generator=self.data)
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.trainer["step"] += 1
        self.losses[self.trainer["step"]] = loss.item()

    def full_state(self) -> dict[str, Any]:
        """Unsharded state (a collective: every rank calls it; rank 0 keeps the result)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": get_model_state_dict(self.model, options=options),
            "optim": get_optimizer_state_dict(self.model, self.optim, options=options),
            "scheduler": self.scheduler.state_dict(),
            "step": self.trainer["step"],
            "data_rng": self.data.get_state(),
            "losses": self.losses,
        }


def assert_same_full_state(resumed: dict[str, Any], reference: dict[str, Any]) -> None:
    """Two :meth:`FsdpTraining.full_state` dumps agree bit for bit (model, optimizer, scheduler,
    step, data position)."""
    for part in ("model", "optim", "scheduler", "step", "data_rng"):
        assert_equal(resumed[part], reference[part], part)


def run_phase(rank: int, phase: Phase) -> None:
    """The body of one spawned rank; a rank that succeeds skips interpreter teardown.

    A spawned rank that returns normally sometimes aborts while the interpreter shuts down
    ("terminate called without an active exception": a C++ thread of gloo/c10d destroyed while
    still joinable), after all its work is done and checked. Leaving with ``os._exit(0)`` once
    everything is written keeps that teardown out of the test's verdict; failures still raise.
    """
    _run_phase(rank, phase)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_phase(rank: int, phase: Phase) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{phase.init_file}", rank=rank, world_size=phase.world_size
    )
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (phase.world_size,))
        if phase.reference_steps:
            reference = FsdpTraining(mesh, phase.seed)
            for _ in range(phase.reference_steps):
                reference.step()
            state = reference.full_state()
            if rank == 0:
                torch.save(state, phase.out_file + ".ref")
        # Other initial weights than the reference's, so a resumed run gets all of it from storage.
        training = FsdpTraining(mesh, phase.seed if phase.expect_resume == 0 else phase.seed + 1)
        with Checkpointer(phase.url, phase.storage_options, async_mode=phase.async_mode) as ckpt:
            resumed = ckpt.load(**training.keys())
            assert resumed == phase.expect_resume, (
                f"rank {rank} resumed from {resumed}, not {phase.expect_resume}"
            )
            training.after_load()
            ckpt.prepare(**training.keys())  # asynchronous saves: buffers ahead of the first save
            while training.trainer["step"] < phase.stop_at:
                training.step()
                if training.trainer["step"] % phase.save_every == 0:
                    ckpt.save(training.trainer["step"], **training.keys())
            ckpt.wait()  # an asynchronous save in flight is not committed yet
            latest = ckpt.latest_checkpoint()
        state = training.full_state()
        if rank == 0:
            torch.save({**state, "latest": latest}, phase.out_file)
    finally:
        dist.destroy_process_group()
