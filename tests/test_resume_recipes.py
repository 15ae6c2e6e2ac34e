"""Each way the docs resume a Checkpointer run ends where a run that never stopped ends.

A run trains, saves, loses a step of work and stops. A fresh process's objects resume it and
train on. Weights, AdamW's moments, the scheduler and the data position then equal, bit for bit,
those of a run that was never interrupted. Asynchronous saves have the same test in
test_async_checkpointer.py, and each integration in its own module under tests/integrations/.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from dcp_fsspec import Checkpointer, LocalTier
from tests.ckpt_helpers import Training, assert_same_training
from tests.conftest import Backend

RECIPES = {
    "plain": lambda tmp: {},
    "incremental": lambda tmp: {"incremental": True, "keep_last_n": 2},
    "two-tiers": lambda tmp: {"local_tier": LocalTier(str(tmp / "nvme"), keep_last_n=1)},
    "two-tiers-local-copy-lost": lambda tmp: {"local_tier": LocalTier(str(tmp / "nvme"), keep_last_n=1)},
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_resumed_run_trains_on_to_the_state_of_a_run_never_stopped(
    shared_backend: Backend, tmp_path: Path, recipe: str
) -> None:
    options: dict[str, Any] = RECIPES[recipe](tmp_path)
    lost = recipe.endswith("-lost")
    never_stopped = Training()
    never_stopped.run(8)

    first = Training()
    with Checkpointer(shared_backend.url, shared_backend.storage_options, **options) as ckpt:
        for iteration in (2, 4):
            first.run(2)
            ckpt.save(iteration, **first.keys())
        first.run(1)  # work lost by the stop
    if lost:
        shutil.rmtree(tmp_path / "nvme")  # a replacement machine: the durable tier alone

    resumed = Training(seed=7)  # other weights and data: everything must come from storage
    with Checkpointer(shared_backend.url, shared_backend.storage_options, **options) as ckpt:
        assert ckpt.load(**resumed.keys()) == 4
        resumed.after_load()
        resumed.run(4)
    assert_same_training(resumed, never_stopped)
    assert resumed.losses == never_stopped.losses[4:]
