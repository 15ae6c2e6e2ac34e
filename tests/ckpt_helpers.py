"""Helpers for the checkpointer tests: a tiny seeded training run, and exact comparisons.

Everything a resume needs is in ``Training.keys()``: weights, AdamW state, the LR scheduler and a
trainer dict holding the step and the data generator's state, so a resumed run can be compared
bit for bit with an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Training:
    """A two-layer MLP fitting random targets with AdamW and a StepLR schedule."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optim, step_size=2, gamma=0.7)
        self.data = torch.Generator().manual_seed(seed + 1)
        self.trainer: dict[str, Any] = {"step": 0, "data_rng": self.data.get_state(), "note": f"seed {seed}"}
        self.losses: list[float] = []

    def keys(self) -> dict[str, Any]:
        """The keywords for ``Checkpointer.save``/``load``."""
        self.trainer["data_rng"] = self.data.get_state()
        return {
            "model": self.model,
            "optim": self.optim,
            "scheduler": self.scheduler,
            "trainer": self.trainer,
        }

    def after_load(self) -> None:
        self.data.set_state(self.trainer["data_rng"])

    def run(self, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(8, 6, generator=self.data)
            y = torch.randn(8, 3, generator=self.data)
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optim.step()
            self.optim.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.trainer["step"] += 1
            self.losses.append(loss.item())


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    """``a == b`` exactly, recursing through dicts and lists; tensors compared bitwise."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (
            f"{where}: {a} != {b}"
        )
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_training(a: Training, b: Training) -> None:
    """Weights, optimizer, scheduler, step and data position all bitwise equal.

    A loaded ``Training`` must have had ``after_load()`` called, as a training loop would.
    """
    assert_equal(a.model.state_dict(), b.model.state_dict(), "model")
    assert_equal(a.optim.state_dict(), b.optim.state_dict(), "optim")
    assert_equal(a.scheduler.state_dict(), b.scheduler.state_dict(), "scheduler")
    assert (a.trainer["step"], a.trainer["note"]) == (b.trainer["step"], b.trainer["note"])
    assert_equal(a.data.get_state(), b.data.get_state(), "data generator")


def save_twice_and_resume(url: str, storage_options: dict[str, Any], **checkpointer_options: Any) -> None:
    """Train, save iterations 1 and 2 (keep_last_n=1) and resume from the pointer: the resumed
    training must match the saved one exactly, and only iteration 2 stay committed."""
    from dcp_fsspec import Checkpointer  # here: the other helpers need no storage

    training = Training()
    with Checkpointer(url, storage_options, keep_last_n=1, **checkpointer_options) as ckpt:
        for iteration in (1, 2):
            training.run(1)
            ckpt.save(iteration, **training.keys())
        resumed = Training(seed=5)
        assert ckpt.load(**resumed.keys()) == 2
        assert ckpt.committed_iterations() == [2]
    resumed.after_load()
    assert_same_training(resumed, training)
