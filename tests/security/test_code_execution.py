"""A checkpoint we did not write runs no code: not through ``.metadata``, not through non-tensor entries.

Every way we read a checkpoint is tried with a crafted file whose unpickling would create a
marker file: the Checkpointer (``save_dirname`` and ``load_path``), ``dcp.load`` with our reader,
and the CLI's ``inspect``, ``verify``, ``to-torch`` and ``to-safetensors``. The marker never
appears, and the error is a ``CorruptCheckpointError`` naming the file and the refused callable.
Checkpoints written by torch's own writers and by ours still load with the safe defaults, and
``trust_checkpoint=True`` still loads one's own checkpoint holding any picklable object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from dcp_fsspec import (
    Checkpointer,
    CorruptCheckpointError,
    FsspecStorageReader,
    ReaderSettings,
    ResumeOptions,
    SafeLoadPlanner,
    cli,
)
from dcp_fsspec.storage.checkpoint_files.integrity import verify_checkpoint
from dcp_fsspec.tools.convert import load_state_dict
from tests.conftest import Backend
from tests.helpers import save
from tests.security.crafted import PAYLOADS, Note, edit_metadata, load_failure, smuggle
from tests.states import assert_state_equal, empty_like_state, sample_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


@pytest.fixture(params=sorted(PAYLOADS))
def payload(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, str, Path]:
    """(payload object, the name it is pickled under, the marker it would create)."""
    cls, name = PAYLOADS[request.param]
    marker = tmp_path / "marker"
    return cls(str(marker)), name, marker


def _assert_refused(error: BaseException, url: str, name: str, marker: Path) -> None:
    assert isinstance(error, CorruptCheckpointError), repr(error)
    assert url in str(error) and name in str(error) and "trust_checkpoint=True" in str(error)
    assert not marker.exists(), "the checkpoint ran code"


# -- .metadata -------------------------------------------------------------------------------------


def test_a_crafted_metadata_runs_no_code_in_checkpointer_load(
    local_backend: Backend, payload: tuple[Any, str, Path]
) -> None:
    obj, name, marker = payload
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(1, model=_model())
    url = edit_metadata(local_backend, local_backend.sub("iter_000000001", "model"), smuggle(obj))
    with Checkpointer(local_backend.url) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(model=_model())
    _assert_refused(info.value, url, name, marker)


def test_a_crafted_metadata_runs_no_code_through_load_path(
    local_backend: Backend, payload: tuple[Any, str, Path]
) -> None:
    obj, name, marker = payload
    source = local_backend.sub("downloaded")
    save(_model().state_dict(), local_backend, source)
    url = edit_metadata(local_backend, source, smuggle(obj))
    with (
        Checkpointer(local_backend.sub("run"), resume=ResumeOptions(load_path=source)) as ckpt,
        pytest.raises(CorruptCheckpointError) as info,
    ):
        ckpt.load(model=_model())
    _assert_refused(info.value, url, name, marker)


def test_a_crafted_metadata_runs_no_code_in_dcp_load_with_our_reader_nor_in_verify_checkpoint(
    memory_backend: Backend, payload: tuple[Any, str, Path]
) -> None:
    obj, name, marker = payload
    save({"w": torch.randn(3)}, memory_backend)
    url = edit_metadata(memory_backend, memory_backend.url, smuggle(obj))
    _assert_refused(load_failure({"w": torch.zeros(3)}, memory_backend), url, name, marker)
    report = verify_checkpoint(memory_backend.url)  # damage is reported, not raised
    assert not report.ok and [p.url for p in report.problems] == [url]
    assert name in report.problems[0].what and not marker.exists()


@pytest.mark.parametrize("command", ["inspect", "verify", "to-torch", "to-safetensors"])
def test_a_crafted_metadata_runs_no_code_in_the_cli(
    local_backend: Backend,
    payload: tuple[Any, str, Path],
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    obj, name, marker = payload
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(1, model=_model())
    url = edit_metadata(local_backend, local_backend.sub("iter_000000001", "model"), smuggle(obj))
    out = [str(tmp_path / "out.pt")] if command.startswith("to-") else []
    code = cli.main([command, local_backend.url, *out])
    printed = "".join(capsys.readouterr())
    assert code == 1, printed
    assert url in printed and name in printed and "--trust" in printed
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


# -- non-tensor entries ----------------------------------------------------------------------------


def test_a_crafted_object_entry_runs_no_code_in_checkpointer_load(
    local_backend: Backend, payload: tuple[Any, str, Path]
) -> None:
    obj, name, marker = payload
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(1, model=_model(), extra={"payload": obj, "step": 7})
    with Checkpointer(local_backend.url) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(model=_model(), extra={"payload": None, "step": 0})
    _assert_refused(info.value, local_backend.sub("iter_000000001", "extra"), name, marker)
    assert "'payload'" in str(info.value) and "add_safe_globals" in str(info.value)


def test_a_crafted_object_entry_runs_no_code_in_dcp_load_with_the_safe_planner(
    memory_backend: Backend, payload: tuple[Any, str, Path]
) -> None:
    obj, name, marker = payload
    save({"w": torch.randn(3), "payload": obj}, memory_backend)
    error = load_failure({"w": torch.zeros(3), "payload": None}, memory_backend, planner=SafeLoadPlanner())
    _assert_refused(error, memory_backend.url, name, marker)


def test_our_reader_hands_torchs_default_planner_no_object_it_would_unpickle_in_full(
    memory_backend: Backend, payload: tuple[Any, str, Path]
) -> None:
    obj, name, marker = payload
    save({"w": torch.randn(3), "payload": obj}, memory_backend)
    _assert_refused(
        load_failure({"w": torch.zeros(3), "payload": None}, memory_backend), memory_backend.url, name, marker
    )


@pytest.mark.parametrize("command", ["to-torch", "to-safetensors"])
def test_a_crafted_object_entry_runs_no_code_in_a_conversion(
    local_backend: Backend,
    payload: tuple[Any, str, Path],
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    obj, name, marker = payload
    save({"w": torch.randn(3), "payload": obj}, local_backend)
    out = tmp_path / "out.safetensors"  # one file: to-safetensors' folder export never reads the entry
    code = cli.main([command, local_backend.url, str(out)])
    printed = "".join(capsys.readouterr())
    assert code == 1, printed
    assert name in printed and "'payload'" in printed and "--trust" in printed
    assert not marker.exists() and not out.exists()


# -- what still loads ------------------------------------------------------------------------------


@pytest.mark.parametrize("writer", ["ours", "FileSystemWriter", "FileSystemWriter(Path)", "FsspecWriter"])
def test_checkpoints_of_torch_writers_and_ours_load_with_the_safe_defaults(
    writer: str, tmp_path: Path
) -> None:
    state = sample_state()  # every dtype, views, empty tensors, and non-tensor entries
    source = tmp_path / "ckpt"
    if writer == "ours":
        save(state, Backend("local", str(source)))
    elif writer == "FsspecWriter":
        dcp.save(state, storage_writer=FsspecWriter(f"file://{source}"), no_dist=True)
    else:  # FileSystemWriter stores its folder as given, a pathlib path included
        path = source if writer.endswith("(Path)") else str(source)
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    with Checkpointer(tmp_path / "run", resume=ResumeOptions(load_path=source)) as ckpt:
        target = empty_like_state(state)
        assert ckpt.load(model=target) == 0
    assert_state_equal(target, state)
    assert_state_equal(load_state_dict(source), state)
    target = empty_like_state(state)
    dcp.load(target, storage_reader=FsspecStorageReader(source), planner=SafeLoadPlanner(), no_dist=True)
    assert_state_equal(target, state)
    assert verify_checkpoint(source).ok


def test_the_safe_planner_loads_classes_allowed_with_add_safe_globals(memory_backend: Backend) -> None:
    save({"note": Note("hi")}, memory_backend)
    target: dict[str, Any] = {"note": None}
    with torch.serialization.safe_globals([Note]):
        dcp.load(
            target,
            storage_reader=FsspecStorageReader(memory_backend.url),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert target == {"note": Note("hi")}


def test_trust_checkpoint_loads_ones_own_checkpoint_holding_any_picklable_object(
    local_backend: Backend,
) -> None:
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(1, model=_model(), extra={"note": Note("mine")})
    edit_metadata(local_backend, local_backend.sub("iter_000000001", "extra"), smuggle(Note("in .metadata")))
    with (
        Checkpointer(local_backend.url) as ckpt,
        pytest.raises(CorruptCheckpointError, match=r"tests\.security\.crafted\.Note"),
    ):
        ckpt.load(model=_model(), extra={"note": None})
    extra: dict[str, Any] = {"note": None}
    with Checkpointer(local_backend.url, reader_settings=ReaderSettings(trust_checkpoint=True)) as ckpt:
        assert ckpt.load(model=_model(), extra=extra) == 1
    assert extra == {"note": Note("mine")}
    reader = FsspecStorageReader(
        local_backend.sub("iter_000000001", "extra"), settings=ReaderSettings(trust_checkpoint=True)
    )
    assert reader.read_metadata().__dict__["extra"] == Note("in .metadata")


@pytest.mark.parametrize("command", ["inspect", "verify", "to-torch"])
def test_the_cli_trusts_a_checkpoint_with_trust(
    local_backend: Backend, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save({"w": torch.randn(3), "note": Note("mine")}, local_backend)
    edit_metadata(local_backend, local_backend.url, smuggle(Note("in .metadata")))
    out = [str(tmp_path / "out.pt")] if command.startswith("to-") else []
    assert cli.main([command, local_backend.url, *out]) == 1
    capsys.readouterr()
    assert cli.main([command, local_backend.url, *out, "--trust"]) == 0, capsys.readouterr()
    if out:
        assert torch.load(out[0], weights_only=False)["note"] == Note("mine")
