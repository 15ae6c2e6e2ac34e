"""SafetensorsExport: a Checkpointer's committed iterations exported on a thread of their own."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from dcp_fsspec import Checkpointer
from dcp_fsspec.errors import UsageError
from dcp_fsspec.tools.safetensors.export import INDEX_NAME
from dcp_fsspec.tools.safetensors.on_save import SafetensorsExport

safetensors_torch = pytest.importorskip("safetensors.torch")


def _load_folder(folder: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        loaded.update(safetensors_torch.load_file(str(shard)))
    return loaded


def test_every_second_committed_iteration_of_an_async_run_is_exported_equal_to_the_model(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    export = SafetensorsExport(str(tmp_path / "hf" / "step-{iteration}"), every=2, max_shard_size=1000)
    states = {}
    with Checkpointer(str(tmp_path / "run"), async_mode="async_with_pinned_mem", on_event=export) as ckpt:
        for iteration in (1, 2, 3):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            states[iteration] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save(iteration, model=model)
    export.close()
    assert not (tmp_path / "hf" / "step-1").exists() and not (tmp_path / "hf" / "step-3").exists()
    assert (tmp_path / "hf" / "step-2" / INDEX_NAME).exists()
    loaded = _load_folder(tmp_path / "hf" / "step-2")
    assert sorted(loaded) == sorted(states[2])
    assert all(torch.equal(loaded[k], v) for k, v in states[2].items())


def test_a_failing_export_is_a_warning_naming_its_url_training_goes_on_and_wait_raises_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    dst = str(tmp_path / "hf")
    export = SafetensorsExport(dst, key_map=lambda name: "same")  # two tensors, one name
    with caplog.at_level(logging.WARNING), Checkpointer(str(tmp_path / "run"), on_event=export) as ckpt:
        ckpt.save(1, model=model)
        with pytest.raises(UsageError, match=dst):
            export.wait()
        ckpt.save(2, model=model)  # training goes on
        assert ckpt.latest_checkpoint() == "iter_000000002"
    assert any(r.levelno == logging.WARNING and dst in r.getMessage() for r in caplog.records)
    with pytest.raises(UsageError, match=dst):
        export.close()


def test_close_waits_for_the_export_of_the_last_committed_iteration(tmp_path: Path) -> None:
    model = nn.Linear(256, 256)
    export = SafetensorsExport(str(tmp_path / "hf"))
    with Checkpointer(str(tmp_path / "run"), on_event=export) as ckpt:
        ckpt.save(7, model=model)
    export.close()
    loaded = _load_folder(tmp_path / "hf")
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
