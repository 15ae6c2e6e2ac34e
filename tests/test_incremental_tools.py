"""Every tool follows an incremental save's references; ``cp`` and the drain write copies that stand alone.

A run of three incremental saves: a frozen base that never changes (written once, then referred
to) and a head that changes every save. ``verify`` checks referenced files like the key's own and
counts their bytes apart; ``cp`` of an iteration is a plain torch checkpoint; ``to-torch``,
``to-safetensors`` and ``inspect`` read through the references; the drain of a local tier
uploads only new bytes, and copies the referenced records in where ``save_dirname`` lacks them.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from dcp_fsspec import Checkpointer, CorruptCheckpointError, FsspecStorageWriter, LocalTier, cli, verify
from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.checkpoint.commit.commit_record import read_commit_record, retired_mark
from dcp_fsspec.checkpoint.events import CheckpointEvent
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, METADATA_NAME
from dcp_fsspec.storage.transport.urls import resolve
from dcp_fsspec.tools.transfer import copy_checkpoint
from tests.conftest import Backend

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),
]

BASE_DIM = 512  # the frozen base: 1 MiB of float32


class Frozen(nn.Module):
    """A frozen base Linear and a small head that each save changes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(BASE_DIM, BASE_DIM)
        self.head = nn.Linear(BASE_DIM, 4)

    def step(self, iteration: int) -> None:
        with torch.no_grad():
            self.head.weight.add_(float(iteration + 1))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(
    root: str | Path, saves: int = 3, storage_options: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """``saves`` incremental saves of key ``model`` under ``root``; the last state saved."""
    model = Frozen()
    with Checkpointer(str(root), storage_options, incremental=True) as ckpt:
        for iteration in range(saves):
            model.step(iteration)
            ckpt.save(iteration, model=model)
    return _state(model)


def _key(root: str | Path, iteration: int) -> str:
    return f"{root}/{layout.format_iteration(iteration)}/model"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def _torch_load(folder: str | Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``folder`` read with torch's own reader (local disk)."""
    state = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(state, storage_reader=FileSystemReader(str(folder)))
    return state


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def _data_files(folder: str | Path) -> list[str]:
    with open(Path(folder) / METADATA_NAME, "rb") as f:
        metadata: Metadata = pickle.load(f)
    return sorted({info.relative_path for info in metadata.storage_data.values()})


# --- verify -----------------------------------------------------------------------------------------


def test_verify_of_an_incremental_run_is_clean_and_counts_the_referenced_bytes(tmp_path: Path) -> None:
    _run(tmp_path / "run")

    report = verify(tmp_path / "run")

    assert report.ok, report.problems
    assert report.tensors_checked == 3 * 4  # every tensor of every iteration, referenced ones included
    base_bytes = BASE_DIM * BASE_DIM * 4
    assert report.referenced_bytes > 2 * base_bytes  # iterations 1 and 2 refer to iteration 0's base
    assert base_bytes < report.own_bytes < 2 * base_bytes


def test_verify_reports_a_deleted_referenced_file_naming_it_and_the_checkpoint_that_refers_to_it(
    tmp_path: Path,
) -> None:
    _run(tmp_path / "run")
    [data] = [f for f in Path(_key(tmp_path / "run", 0)).iterdir() if f.suffix == ".distcp"]
    data.unlink()

    report = verify(tmp_path / "run" / layout.format_iteration(2))

    [problem] = report.problems
    assert problem.url == str(data)
    assert "does not exist" in problem.what and _key(tmp_path / "run", 2) in problem.what


def _plain(tmp_path: Path) -> dict[str, torch.Tensor]:
    """A plain layout: ``step-20`` an incremental save whose base is its sibling ``step-10``."""
    model = Frozen()
    dcp.save(model.state_dict(), storage_writer=FsspecStorageWriter(tmp_path / "step-10", incremental=True))
    model.step(0)
    dcp.save(
        model.state_dict(),
        storage_writer=FsspecStorageWriter(
            tmp_path / "step-20", incremental=True, base=str(tmp_path / "step-10")
        ),
    )
    return _state(model)


def test_verify_follows_a_plain_layouts_references_only_with_references(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _plain(tmp_path)

    code, out = _cli(capsys, "verify", str(tmp_path / "step-20"))
    assert code == 1
    assert "--references" in out and "../step-10/" in out and str(tmp_path / "step-20") in out

    report = verify(tmp_path / "step-20", references=True)
    assert report.ok, report.problems
    assert report.referenced_bytes >= BASE_DIM * BASE_DIM * 4


# --- cp -------------------------------------------------------------------------------------------


def test_cp_of_an_incremental_iteration_is_a_plain_torch_checkpoint_bit_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = _run(tmp_path / "run")

    code, out = _cli(capsys, "cp", str(tmp_path / "run" / layout.format_iteration(2)), str(tmp_path / "copy"))

    assert code == 0, out
    assert "referenced" in out
    assert not [name for name in _data_files(tmp_path / "copy" / "model") if ".." in name]
    _assert_equal(_torch_load(tmp_path / "copy" / "model", expected), expected)
    assert verify(tmp_path / "copy" / "model").referenced_bytes == 0


def test_cp_of_an_incremental_key_to_s3_and_back_loads_bit_exact(s3_backend: Backend, tmp_path: Path) -> None:
    expected = _run(tmp_path / "run")

    copy_checkpoint(_key(tmp_path / "run", 2), s3_backend.url, dst_storage_options=s3_backend.storage_options)
    copy_checkpoint(s3_backend.url, tmp_path / "back", s3_backend.storage_options)

    assert not [name for name in _data_files(tmp_path / "back") if ".." in name]
    _assert_equal(_torch_load(tmp_path / "back", expected), expected)


def test_cp_of_a_plain_layouts_incremental_save_copies_its_sibling_base_in_only_with_references(
    tmp_path: Path,
) -> None:
    expected = _plain(tmp_path)

    with pytest.raises(CorruptCheckpointError, match="--references") as raised:
        copy_checkpoint(tmp_path / "step-20", tmp_path / "copy")
    assert str(tmp_path / "step-20") in str(raised.value) and str(tmp_path / "step-10") in str(raised.value)
    assert not (tmp_path / "copy").exists()

    copy_checkpoint(tmp_path / "step-20", tmp_path / "copy", references=True)
    assert not [name for name in _data_files(tmp_path / "copy") if ".." in name]
    _assert_equal(_torch_load(tmp_path / "copy", expected), expected)


def test_cp_of_a_whole_run_copies_in_the_records_of_a_retired_iteration_it_does_not_copy(
    tmp_path: Path,
) -> None:
    expected = _run(tmp_path / "run")
    root = resolve(tmp_path / "run")
    record = read_commit_record(root, 0)
    assert record is not None
    (tmp_path / "run" / layout.format_iteration(0) / COMMIT_RECORD_NAME).write_bytes(retired_mark(record))

    copy_checkpoint(tmp_path / "run", tmp_path / "copy")

    assert not (tmp_path / "copy" / layout.format_iteration(0)).exists()
    assert not [name for name in _data_files(_key(tmp_path / "copy", 2)) if ".." in name]
    model = Frozen()
    assert Checkpointer(str(tmp_path / "copy")).load(model=model) == 2
    _assert_equal(_state(model), expected)


def test_cp_of_a_whole_run_keeps_the_references_to_the_iterations_it_copies(tmp_path: Path) -> None:
    _run(tmp_path / "run")

    result = copy_checkpoint(tmp_path / "run", tmp_path / "copy")

    assert result.referenced_bytes == 0
    assert _data_files(_key(tmp_path / "copy", 2)) == _data_files(_key(tmp_path / "run", 2))


# --- to-torch, to-safetensors, inspect --------------------------------------------------------------


def test_to_torch_of_an_incremental_key_equals_the_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = _run(tmp_path / "run")

    code, out = _cli(capsys, "to-torch", _key(tmp_path / "run", 2), str(tmp_path / "model.pt"))

    assert code == 0, out
    _assert_equal(torch.load(tmp_path / "model.pt", weights_only=True), expected)


def test_to_safetensors_of_an_incremental_key_equals_the_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = _run(tmp_path / "run")

    code, out = _cli(capsys, "to-safetensors", _key(tmp_path / "run", 2), str(tmp_path / "st"))

    assert code == 0, out
    loaded: dict[str, torch.Tensor] = {}
    for shard in (tmp_path / "st").glob("*.safetensors"):
        loaded |= load_file(shard)
    _assert_equal(loaded, expected)


def test_inspect_shows_per_key_the_bytes_of_its_own_and_those_referenced_in_an_older_iteration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(tmp_path / "run")

    code, out = _cli(capsys, "inspect", str(tmp_path / "run"), "--json")

    assert code == 0, out
    [key] = json.loads(out)["keys"]
    base_bytes = BASE_DIM * BASE_DIM * 4
    assert key["referenced_from"] == {layout.format_iteration(0): key["referenced_bytes"]}
    assert key["referenced_bytes"] >= base_bytes > key["own_bytes"] > 0
    assert key["own_bytes"] + key["referenced_bytes"] == key["stored_bytes"]
    _, text = _cli(capsys, "inspect", str(tmp_path / "run"))
    assert f"referenced: 1.0 MiB in {layout.format_iteration(0)}" in text


# --- the two tiers' drain -------------------------------------------------------------------------


def _tiered_saves(
    durable: Path, local: Path, iterations: range, model: Frozen, between: Any = None
) -> list[CheckpointEvent]:
    """Incremental saves with a local tier (which keeps every iteration); the drain_end events."""
    drains: list[CheckpointEvent] = []
    tier = LocalTier(str(local), keep_last_n=10)

    def on_event(event: CheckpointEvent) -> None:
        if event.kind == "drain_end":
            drains.append(event)

    with Checkpointer(str(durable), incremental=True, local_tier=tier, on_event=on_event) as ckpt:
        for iteration in iterations:
            model.step(iteration)
            ckpt.save(iteration, model=model)
            ckpt.wait()
            if between is not None:
                between(iteration)
    assert all(event.error is None for event in drains), [event.error for event in drains]
    return drains


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _load_alone(durable: Path, iteration: int, expected: dict[str, torch.Tensor]) -> None:
    model = Frozen()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert Checkpointer(str(durable)).load(model=model, iteration=iteration) == iteration
    _assert_equal(_state(model), expected)


def test_the_drains_of_an_incremental_run_upload_only_new_bytes_and_every_durable_copy_verifies(
    tmp_path: Path,
) -> None:
    model, states = Frozen(), {}
    drains = _tiered_saves(
        tmp_path / "durable",
        tmp_path / "local",
        range(3),
        model,
        between=lambda i: states.setdefault(i, _state(model)),
    )
    shutil.rmtree(tmp_path / "local")  # the durable copies alone

    assert [event.iteration for event in drains] == [0, 1, 2]
    first, second, third = (event.nbytes for event in drains)
    assert second * 10 < first and third * 10 < first
    stored = [_folder_bytes(tmp_path / "durable" / layout.format_iteration(i)) for i in range(3)]
    assert stored[1] * 10 < stored[0] and stored[2] * 10 < stored[0]
    for iteration, state in states.items():
        _load_alone(tmp_path / "durable", iteration, state)
    report = verify(tmp_path / "durable")
    assert report.ok, report.problems
    assert report.referenced_bytes > 0


def test_a_drain_copies_the_referenced_records_in_where_save_dirname_lacks_the_iteration_they_are_in(
    tmp_path: Path,
) -> None:
    model, states = Frozen(), {}

    def lose_the_durable_base(iteration: int) -> None:
        states[iteration] = _state(model)
        if iteration == 0:  # save_dirname loses iteration 0, which the next saves refer to
            fsspec.filesystem("file").rm(
                str(tmp_path / "durable" / layout.format_iteration(0)), recursive=True
            )

    drains = _tiered_saves(
        tmp_path / "durable", tmp_path / "local", range(3), model, between=lose_the_durable_base
    )
    shutil.rmtree(tmp_path / "local")

    # Iteration 1 brings the base in; iteration 2 refers to iteration 0 too, which is still missing.
    assert drains[1].nbytes > BASE_DIM * BASE_DIM * 4 and drains[2].nbytes > BASE_DIM * BASE_DIM * 4
    for iteration in (1, 2):
        assert not [name for name in _data_files(_key(tmp_path / "durable", iteration)) if ".." in name]
        _load_alone(tmp_path / "durable", iteration, states[iteration])
