"""End-to-end flows and format tools through our storage classes (single process, CPU).

Mirrors torch 2.13's ``e2e/test_e2e_save_and_load.py`` (``_run_e2e_test`` with ``ModelType.NONE``,
``test_e2e_async_cached``'s thread flavours, ``test_stateful_and_non_stateful_loads``,
``test_no_dist``, ``test_partial_load``'s ``_load_state_dict_from_keys``), ``test_format_utils.py``
(``dcp_to_torch_save`` / ``torch_save_to_dcp`` round trips, done with our reader and writer) and
``test_compatibility.py`` (``test_sharded_tensor_dependency``). See NOTES.md.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, _load_state_dict_from_keys
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from dcp_fsspec import FsspecStorageReader, FsspecStorageWriter, WriterSettings
from tests.conftest import Backend


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1, self.net2, self.net3 = nn.Linear(8, 16), nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net3(F.relu(self.net2(F.relu(self.net1(x)))))


@dataclass
class TrainState:
    """Tensors and a BytesIO entry, as upstream's TestTrainState."""

    step: int = 0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step, dtype=torch.int32), "losses": buf}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"], weights_only=True)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, state: TrainState) -> torch.Tensor:
    torch.manual_seed(state.step)
    loss = torch.zeros(())
    for _ in range(steps):
        loss = model(torch.rand(8, 8)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        state.step += 1
        state.losses.append(float(loss.detach()))
    return loss


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


class _App(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


@pytest.mark.parametrize(
    "how",
    ["sync", "async_thread", "async_thread_cached", pytest.param("zstd", id="sync_zstd")],
)
def test_training_resumes_exactly_after_a_save_and_load(backend: Backend, how: str) -> None:
    if how == "zstd":
        pytest.importorskip("zstandard", reason="zstandard is not installed: pip install 'dcp-fsspec[zstd]'")
    model, optim = _fresh()
    train_state = TrainState()
    _train(model, optim, 2, train_state)
    sd = {"app": _App(model, optim), "train_state": train_state}
    options = {"settings": WriterSettings(compression="zstd")} if how == "zstd" else {}
    writer = FsspecStorageWriter(
        backend.url, backend.storage_options, cache_staged_state_dict=how.endswith("cached"), **options
    )
    if how.startswith("async"):
        dcp.async_save(
            sd, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD, no_dist=True
        ).result(timeout=120)
    else:
        dcp.save(sd, storage_writer=writer, no_dist=True)

    model2, optim2 = _fresh()
    train_state2 = TrainState()
    # torch pickles the BytesIO entry itself; the safe default rebuilds it (see NOTES.md).
    reader = FsspecStorageReader(backend.url, backend.storage_options)
    dcp.load({"app": _App(model2, optim2), "train_state": train_state2}, storage_reader=reader, no_dist=True)
    assert train_state2 == train_state
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    # One more step on both: the optimizer state came back too, so the losses agree exactly.
    assert torch.equal(_train(model, optim, 1, train_state), _train(model2, optim2, 1, train_state2))


def test_stateful_entries_load_in_place_and_plain_ones_are_replaced(tmp_path: Path) -> None:
    class Foo(Stateful):
        loaded = False

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.loaded = True

    class Recording(dict):  # type: ignore[type-arg]
        replaced = False

        def __setitem__(self, key: Any, value: Any) -> None:
            self.replaced = True
            super().__setitem__(key, value)

    foo, sd = Foo(), Recording()
    dict.__setitem__(sd, "foo", foo)
    dcp.save(sd, storage_writer=FsspecStorageWriter(tmp_path / "a"), no_dist=True)
    dcp.load(sd, storage_reader=FsspecStorageReader(tmp_path / "a"), no_dist=True)
    assert foo.loaded and not sd.replaced

    sd = Recording()
    dict.__setitem__(sd, "foo", {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]})
    dcp.save(sd, storage_writer=FsspecStorageWriter(tmp_path / "b"), no_dist=True)
    dcp.load(sd, storage_reader=FsspecStorageReader(tmp_path / "b"), no_dist=True)
    assert sd.replaced


def test_an_empty_state_saves_and_loads(backend: Backend) -> None:
    dcp.save({}, storage_writer=FsspecStorageWriter(backend.url, backend.storage_options), no_dist=True)
    dcp.load({}, storage_reader=FsspecStorageReader(backend.url, backend.storage_options), no_dist=True)


def test_partial_load_of_some_keys(tmp_path: Path) -> None:
    model, optim = _fresh()
    _train(model, optim, 2, TrainState())
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save(
        {"model": model_sd, "optimizer": optim_sd}, storage_writer=FsspecStorageWriter(tmp_path), no_dist=True
    )
    loaded = _load_state_dict_from_keys("model", storage_reader=FsspecStorageReader(tmp_path))["model"]
    assert loaded.keys() == model_sd.keys() and all(torch.equal(loaded[k], v) for k, v in model_sd.items())
    state = _load_state_dict_from_keys("optimizer.state", storage_reader=FsspecStorageReader(tmp_path))[
        "optimizer"
    ]["state"]
    for name, saved in optim_sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[name][key], saved[key])


def test_dcp_to_torch_save_and_back_with_our_classes(tmp_path: Path) -> None:
    """What torch's ``format_utils.dcp_to_torch_save`` / ``torch_save_to_dcp`` do, with our reader
    and writer: a DCP checkpoint becomes one torch.save file and back, unchanged."""
    model, optim = _fresh()
    _train(model, optim, 1, TrainState())
    original = {"model": model.state_dict(), "extra": {"step": 3, "name": "run"}}
    dcp.save(original, storage_writer=FsspecStorageWriter(tmp_path / "dcp"), no_dist=True)
    full: dict[str, Any] = {}
    _load_state_dict(
        full,
        storage_reader=FsspecStorageReader(tmp_path / "dcp"),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    torch.save(full, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=True)
    dcp.save(again, storage_writer=FsspecStorageWriter(tmp_path / "dcp2"), no_dist=True)
    back: dict[str, Any] = {}
    _load_state_dict(
        back,
        storage_reader=FsspecStorageReader(tmp_path / "dcp2"),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    assert back["extra"] == original["extra"]
    assert all(torch.equal(back["model"][k], v) for k, v in original["model"].items())


def test_metadata_naming_the_old_sharded_tensor_properties_still_loads(tmp_path: Path) -> None:
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as OldProperties

    with patch("torch.distributed.checkpoint.metadata.TensorProperties", OldProperties):
        dcp.save({"a": torch.ones(4, 4)}, storage_writer=FsspecStorageWriter(tmp_path), no_dist=True)
    target = {"a": torch.zeros(4, 4)}
    dcp.load(target, storage_reader=FsspecStorageReader(tmp_path), no_dist=True)
    assert torch.equal(target["a"], torch.ones(4, 4))


def test_a_bytesio_entry_round_trips_without_trusting_the_checkpoint(memory_backend: Backend) -> None:
    """torch's e2e train state keeps an ``io.BytesIO``; torch's planner unpickles it in full. Ours
    rebuilds it under the safe default (its contents still go through ``weights_only``'s checks).

    Mirrors: torch 2.13 test/distributed/checkpoint/e2e/test_e2e_save_and_load.py (TestTrainState).
    """
    saved = {"buf": io.BytesIO(b"train state bytes"), "step": 3}
    dcp.save(saved, storage_writer=FsspecStorageWriter(memory_backend.url), no_dist=True)
    loaded: dict[str, Any] = {"buf": io.BytesIO(), "step": 0}
    dcp.load(loaded, storage_reader=FsspecStorageReader(memory_backend.url), no_dist=True)
    assert isinstance(loaded["buf"], io.BytesIO) and loaded["buf"].getvalue() == b"train state bytes"
    assert loaded["step"] == 3
