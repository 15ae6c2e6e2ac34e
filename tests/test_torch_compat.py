"""torch's on-storage format, both ways: torch's readers load ours, ours loads torch's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import Backend
from tests.helpers import differences_outside_the_serialization_id, load, save
from tests.states import assert_state_equal, empty_like_state, sample_state


def test_torch_filesystem_reader_loads_our_local_checkpoint(local_backend: Backend) -> None:
    state = sample_state()
    save(state, local_backend)
    target = empty_like_state(state)
    dcp.load(target, storage_reader=FileSystemReader(local_backend.url), no_dist=True)
    assert_state_equal(target, state)


@pytest.mark.parametrize("name", ["s3", "memory"])
def test_torch_fsspec_reader_loads_our_checkpoint(name: str, request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{name}_backend")
    state = sample_state()
    save(state, backend)
    target = empty_like_state(state)
    dcp.load(target, storage_reader=FsspecReader(backend.url, **backend.storage_options), no_dist=True)
    assert_state_equal(target, state)


@pytest.mark.parametrize("thread_count", [1, 3])
def test_we_load_what_torch_filesystem_writer_wrote(local_backend: Backend, thread_count: int) -> None:
    state = sample_state()
    dcp.save(
        state, storage_writer=FileSystemWriter(local_backend.url, thread_count=thread_count), no_dist=True
    )
    assert_state_equal(load(empty_like_state(state), local_backend), state)


@pytest.mark.parametrize("name", ["s3", "memory"])
def test_we_load_what_torch_fsspec_writer_wrote(name: str, request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{name}_backend")
    state = sample_state()
    dcp.save(state, storage_writer=FsspecWriter(backend.url, **backend.storage_options), no_dist=True)
    assert_state_equal(load(empty_like_state(state), backend), state)


def test_our_records_are_byte_identical_to_torch_save_but_for_the_serialization_id(
    local_backend: Backend,
) -> None:
    # One tensor per file, so each file is exactly one record.
    tensor = torch.randn(33, 17)
    save({"t": tensor}, local_backend)
    ours = (Path(local_backend.url) / "__0_0.distcp").read_bytes()
    theirs_dir = Path(local_backend.url).with_name("theirs")
    dcp.save({"t": tensor}, storage_writer=FileSystemWriter(str(theirs_dir)), no_dist=True)
    theirs = (theirs_dir / "__0_0.distcp").read_bytes()
    # torch writes a fresh 40-byte serialization id per record; it appears in the entry and
    # its CRC in the data descriptor and central directory. Nothing else may differ, by position.
    assert differences_outside_the_serialization_id(ours, theirs) == []


def test_dcp_to_torch_save_converts_our_checkpoint(local_backend: Backend, tmp_path: Path) -> None:
    state = {"w": torch.randn(8, 8), "b": torch.arange(5), "meta": {"step": 3}}
    save(state, local_backend)
    out = tmp_path / "model.pt"
    dcp_to_torch_save(local_backend.url, str(out))
    converted = torch.load(out, weights_only=False)
    assert torch.equal(converted["w"], state["w"]) and torch.equal(converted["b"], state["b"])
    assert converted["meta"] == {"step": 3}
