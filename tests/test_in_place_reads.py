"""Loads read big records straight into their tensors (local files and S3); every other way of
loading them must agree, and damage must be found the same way."""

from __future__ import annotations

import ctypes
import posixpath

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import FsspecStorageReader, FsspecStorageWriter, ReaderSettings, WriterSettings
from dcp_fsspec.errors import ChecksumMismatchError, CorruptCheckpointError
from dcp_fsspec.storage.backends.s3 import S3Backend
from dcp_fsspec.storage.read import reader as reader_module
from dcp_fsspec.storage.read.fetch import fetch_in_order
from tests.conftest import Backend
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


@pytest.fixture(params=["local", "s3", "s3_obstore", "gcs", "azure"])
def place(request: pytest.FixtureRequest) -> Backend:
    """The backends whose loads read in place."""
    return request.getfixturevalue(f"{request.param}_backend")


def _save(place: Backend, state: dict[str, torch.Tensor]) -> str:
    dcp.save(
        state,
        storage_writer=FsspecStorageWriter(
            place.url, place.storage_options, settings=WriterSettings(files_per_rank=1)
        ),
    )
    return place.url


def _reader(place: Backend, **settings: int) -> FsspecStorageReader:
    return FsspecStorageReader(place.url, place.storage_options, settings=ReaderSettings(**settings))


@pytest.mark.parametrize("max_request_mib", [16, 1])  # one read per record, or several pieces each
def test_big_records_load_bit_exact_in_place(
    place: Backend, max_request_mib: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    _save(place, state)
    streamed: list[int] = []

    def spy(fs: object, spans: list, **kwargs: object) -> object:
        streamed.extend(span.size for span in spans)
        return fetch_in_order(fs, spans, **kwargs)

    monkeypatch.setattr(reader_module, "fetch_in_order", spy)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=_reader(place, max_request_bytes=max_request_mib * MiB))
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    # Only the records under the in-place size went through the window: from a remote store a
    # record must fill a request of its own.
    in_place_min = MiB if place.name == "local" else max_request_mib * MiB
    under = sum(v.nbytes for v in state.values() if v.nbytes < in_place_min)
    assert under <= sum(streamed) < under + MiB


def test_s3_response_bodies_of_big_records_are_read_into_the_target_tensors_memory(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    _save(s3_backend, state)
    filled: list[tuple[int, int]] = []  # (address, length) of the memory each GET body went into
    read_into = S3Backend.read_range_into_async

    async def spy(self: S3Backend, path: str, start: int, view: memoryview) -> int:
        filled.append((ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view)))
        return await read_into(self, path, start, view)

    monkeypatch.setattr(S3Backend, "read_range_into_async", spy)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=_reader(s3_backend, max_request_bytes=MiB))
    assert all(torch.equal(target[k], v) for k, v in state.items())
    spans = {k: (t.data_ptr(), t.data_ptr() + t.nbytes) for k, t in target.items()}
    in_targets = {k: 0 for k in spans}
    for address, length in filled:
        for k, (lo, hi) in spans.items():
            if lo <= address and address + length <= hi:
                in_targets[k] += length
    # Every data byte of the big records landed in its tensor directly, the bytes before it
    # (the header, read with the record's first bytes) aside.
    for k in ("big", "wide", "ints"):
        assert spans[k][1] - spans[k][0] - in_targets[k] < 64 * 1024, k


def test_a_target_that_needs_a_copy_still_loads_from_an_in_place_read(place: Backend) -> None:
    state = _state()
    _save(place, state)
    # A transposed (non-contiguous) target: the record is read whole, then copied.
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["wide"] = torch.zeros(1024, 512, dtype=torch.bfloat16).t()
    dcp.load(target, storage_reader=_reader(place, max_request_bytes=MiB))  # in place on every backend
    for k, v in state.items():
        assert torch.equal(target[k], v), k


def _data_file(place: Backend) -> tuple[fsspec.AbstractFileSystem, str]:
    fs = place.fs
    (path,) = [p for p in fs.find(fsspec.core.strip_protocol(place.url)) if p.endswith(".distcp")]
    return fs, path


def test_a_flipped_byte_in_a_big_record_fails_its_checksum(place: Backend) -> None:
    state = _state()
    _save(place, state)
    fs, path = _data_file(place)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(path, bytes(data))
    with raises_through_dcp(ChecksumMismatchError) as raised:
        dcp.load({k: torch.zeros_like(v) for k, v in state.items()}, storage_reader=_reader(place))
    assert posixpath.basename(path) in str(raised.value)


def test_a_file_cut_inside_a_big_record_is_reported_truncated(place: Backend) -> None:
    state = _state()
    _save(place, state)
    fs, path = _data_file(place)
    fs.pipe_file(path, fs.cat_file(path)[: fs.size(path) // 2])
    with raises_through_dcp(CorruptCheckpointError) as raised:
        dcp.load({k: torch.zeros_like(v) for k, v in state.items()}, storage_reader=_reader(place))
    assert posixpath.basename(path) in str(raised.value) and "truncated" in str(raised.value)
