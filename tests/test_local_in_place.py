"""Local loads read big records straight into their tensors; every other way of loading them must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import FsspecStorageReader, FsspecStorageWriter
from dcp_fsspec.errors import ChecksumMismatchError, CorruptCheckpointError
from dcp_fsspec.storage import reader as reader_module
from dcp_fsspec.storage.fetch import fetch_in_order
from tests.helpers import raises_through_dcp

MiB = 1 << 20
GEN = torch.Generator().manual_seed(11)


def _state() -> dict[str, torch.Tensor]:
    return {
        "big": torch.randn(3 * MiB // 4, generator=GEN),  # 3 MiB: read in place
        "wide": torch.randn(512, 1024, generator=GEN).to(torch.bfloat16),  # 1 MiB
        "small": torch.randn(100, generator=GEN),  # streamed
        "ints": torch.randint(0, 1 << 40, (300_000,), generator=GEN),
    }


def _save(tmp_path: Path, state: dict[str, torch.Tensor]) -> str:
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FsspecStorageWriter(url, files_per_rank=1))
    return url


@pytest.mark.parametrize("max_request_mib", [16, 1])  # one read per record, or several pieces each
def test_big_records_load_bit_exact_in_place(
    tmp_path: Path, max_request_mib: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    url = _save(tmp_path, state)
    streamed: list[int] = []

    def spy(fs: object, spans: list, **kwargs: object) -> object:
        streamed.extend(span.size for span in spans)
        return fetch_in_order(fs, spans, **kwargs)

    monkeypatch.setattr(reader_module, "fetch_in_order", spy)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=FsspecStorageReader(url, max_request_bytes=max_request_mib * MiB))
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    assert sum(streamed) < MiB  # only the small records went through the window


def test_a_target_that_needs_a_copy_still_loads_from_an_in_place_read(tmp_path: Path) -> None:
    state = _state()
    url = _save(tmp_path, state)
    # A transposed (non-contiguous) target: the record is read whole, then copied.
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["wide"] = torch.zeros(1024, 512, dtype=torch.bfloat16).t()
    dcp.load(target, storage_reader=FsspecStorageReader(url))
    for k, v in state.items():
        assert torch.equal(target[k], v), k


def _data_file(url: str) -> Path:
    (path,) = Path(url).glob("*.distcp")
    return path


def test_a_flipped_byte_in_a_big_record_fails_its_checksum(tmp_path: Path) -> None:
    state = _state()
    url = _save(tmp_path, state)
    path = _data_file(url)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with raises_through_dcp(ChecksumMismatchError) as raised:
        dcp.load({k: torch.zeros_like(v) for k, v in state.items()}, storage_reader=FsspecStorageReader(url))
    assert path.name in str(raised.value)


def test_a_file_cut_inside_a_big_record_is_reported_truncated(tmp_path: Path) -> None:
    state = _state()
    url = _save(tmp_path, state)
    path = _data_file(url)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with raises_through_dcp(CorruptCheckpointError) as raised:
        dcp.load({k: torch.zeros_like(v) for k, v in state.items()}, storage_reader=FsspecStorageReader(url))
    assert path.name in str(raised.value) and "truncated" in str(raised.value)
