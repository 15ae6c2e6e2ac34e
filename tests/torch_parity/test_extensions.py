"""torch's stream transform extensions (ZStandard, Rot13Example) through our writer and reader.

Mirrors torch 2.13's ``test_file_system_checkpoint_cpu.py`` classes
``TestDistributedStateDictSaveLoadRot13`` and ``TestDistributedStateDictSaveLoadZStandard``
(save with ``_extensions``, load with ``_extension_registry``), in both directions between
torch's classes and ours, on local, ``memory://`` and S3 (moto). See NOTES.md.
"""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import _extension as torch_extension
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.testing._internal.distributed.checkpoint_utils import Rot13Example, get_test_extension_registry

from dcp_fsspec import (
    Checkpointer,
    CorruptCheckpointError,
    FsspecStorageReader,
    FsspecStorageWriter,
    MissingDriverError,
    WriterSettings,
)
from dcp_fsspec.storage.format import transforms
from tests.conftest import Backend
from tests.helpers import load, raises_through_dcp, save
from tests.states import assert_state_equal, empty_like_state, sample_state

needs_zstd = pytest.mark.skipif(
    not ZStandard.is_available(), reason="zstandard is not installed: pip install 'dcp-fsspec[zstd]'"
)


class Blob:
    """A Stateful holding bytes (torch's test's BlobState): a BYTE_IO entry next to tensors."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def _state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "linear.weight": torch.randn(5, 5, generator=gen),
        "emb.weight": torch.randn(2048, 10, generator=gen).to(torch.bfloat16),
        "steps": torch.arange(7),
        "blob": Blob(b"SomeBlobForTesting"),
    }


def _empty() -> dict[str, Any]:
    return {
        "linear.weight": torch.zeros(5, 5),
        "emb.weight": torch.zeros(2048, 10, dtype=torch.bfloat16),
        "steps": torch.zeros(7, dtype=torch.int64),
        "blob": Blob(b""),
    }


def _assert_loaded(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if isinstance(value, Blob):
            assert loaded[key].state == value.state, key
        else:
            assert torch.equal(loaded[key], value), key


def _descriptors(metadata: Any) -> dict[str, Any]:
    return {index.fqn: info.transform_descriptors for index, info in metadata.storage_data.items()}


# --- torch writes, we read -------------------------------------------------------------------


@needs_zstd
@pytest.mark.parametrize("thread_count", [1, 2])
def test_we_load_what_torchs_writer_compressed_with_zstandard(tmp_path: Path, thread_count: int) -> None:
    saved = _state()
    dcp.save(
        saved,
        storage_writer=FileSystemWriter(tmp_path, thread_count=thread_count, _extensions=[ZStandard()]),
        no_dist=True,
    )
    target = _empty()
    dcp.load(target, storage_reader=FsspecStorageReader(tmp_path), no_dist=True)
    _assert_loaded(target, saved)


@needs_zstd
def test_we_load_what_torchs_fsspec_writer_compressed_in_memory(memory_backend: Backend) -> None:
    saved = _state()
    dcp.save(saved, storage_writer=FsspecWriter(memory_backend.url, _extensions=[ZStandard()]), no_dist=True)
    target = _empty()
    dcp.load(target, storage_reader=FsspecStorageReader(memory_backend.url), no_dist=True)
    _assert_loaded(target, saved)


@pytest.mark.parametrize("thread_count", [1, 2])
def test_rot13_both_ways_with_the_test_registry(tmp_path: Path, thread_count: int) -> None:
    saved = _state()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    dcp.save(
        saved,
        storage_writer=FileSystemWriter(theirs, thread_count=thread_count, _extensions=[Rot13Example()]),
        no_dist=True,
    )
    dcp.save(
        saved,
        storage_writer=FsspecStorageWriter(ours, thread_count=thread_count, _extensions=[Rot13Example()]),
        no_dist=True,
    )
    for path, reader in [
        (theirs, FsspecStorageReader(theirs, _extension_registry=get_test_extension_registry())),
        (ours, FileSystemReader(ours, _extension_registry=get_test_extension_registry())),
        (ours, FsspecStorageReader(ours, _extension_registry=get_test_extension_registry())),
    ]:
        target = _empty()
        dcp.load(target, storage_reader=reader, no_dist=True)
        _assert_loaded(target, saved)


# --- we write, torch reads -------------------------------------------------------------------


@needs_zstd
@pytest.mark.parametrize("how", ["_extensions", "compression"])
def test_torchs_reader_loads_what_we_compressed(local_backend: Backend, how: str) -> None:
    saved = _state()
    options: dict[str, Any] = (
        {"_extensions": [ZStandard()]} if how == "_extensions" else {"compression": "zstd"}
    )
    save(saved, local_backend, **options)
    target = _empty()
    dcp.load(target, storage_reader=FileSystemReader(local_backend.url), no_dist=True)
    _assert_loaded(target, saved)


@needs_zstd
@pytest.mark.parametrize("name", ["memory", "s3"])
def test_torchs_fsspec_reader_loads_what_we_compressed_on_object_stores(
    request: pytest.FixtureRequest, name: str
) -> None:
    backend: Backend = request.getfixturevalue(f"{name}_backend")
    saved = _state()
    save(saved, backend, compression="zstd", compression_level=9)
    target = _empty()
    dcp.load(target, storage_reader=FsspecReader(backend.url, **backend.storage_options), no_dist=True)
    _assert_loaded(target, saved)


@needs_zstd
def test_transform_descriptors_are_recorded_exactly_as_torch_records_them(tmp_path: Path) -> None:
    saved = _state()
    chain = lambda: [ZStandard(), Rot13Example()]  # noqa: E731 - two fresh chains, same order
    dcp.save(saved, storage_writer=FileSystemWriter(tmp_path / "theirs", _extensions=chain()), no_dist=True)
    dcp.save(saved, storage_writer=FsspecStorageWriter(tmp_path / "ours", _extensions=chain()), no_dist=True)
    theirs = FileSystemReader(tmp_path / "theirs").read_metadata()
    ours = FileSystemReader(tmp_path / "ours").read_metadata()
    assert _descriptors(ours) == _descriptors(theirs)
    assert set(map(tuple, _descriptors(ours).values())) == {("stream.rot13/1", "stream.zstd/1")}


def test_without_extensions_no_descriptor_field_is_stored(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=FsspecStorageWriter(tmp_path), no_dist=True)
    metadata = FileSystemReader(tmp_path).read_metadata()
    assert all(info.transform_descriptors is None for info in metadata.storage_data.values())
    raw = (tmp_path / ".metadata").read_bytes()
    assert b"transform_descriptors" not in raw  # torch leaves the field out for older readers


@needs_zstd
def test_compressed_records_are_smaller_and_checksummed_inside(local_backend: Backend) -> None:
    zeros = {"w": torch.zeros(1 << 20)}
    save(zeros, local_backend, compression="zstd")
    files = [p for p in Path(local_backend.url).iterdir() if p.suffix == ".distcp"]
    assert sum(p.stat().st_size for p in files) < (1 << 20) * 4 // 100


# --- the read path: one unit, off the event loop, damage and missing packages ---------------------


@needs_zstd
def test_a_compressed_record_bigger_than_a_request_and_the_window_loads_whole(backend: Backend) -> None:
    state = sample_state()
    state["big"] = torch.randn(1 << 19)  # 2 MiB, incompressible: read in place on local disk
    save(state, backend, compression="zstd", compression_level=1)
    loaded = load(empty_like_state(state), backend, window_bytes=256 * 1024, max_request_bytes=64 * 1024)
    assert_state_equal(loaded, state)


@needs_zstd
def test_decompression_runs_on_the_readers_pool_not_fsspecs_event_loop(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"w{i}": torch.randn(4096) for i in range(12)}
    save(state, s3_backend, compression="zstd")
    threads: list[str] = []
    real = transforms.untransform

    def noting_the_thread(*args: Any) -> bytearray:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr("dcp_fsspec.storage.read.delivery.untransform", noting_the_thread)
    loaded = load({k: torch.zeros(4096) for k in state}, s3_backend)
    assert len(threads) == 12 and all(name.startswith("dcp-fsspec-undo") for name in threads), threads
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@needs_zstd
def test_a_damaged_compressed_record_is_reported_with_its_file(local_backend: Backend) -> None:
    save({"w": torch.randn(1 << 16)}, local_backend, compression="zstd")
    (data_file,) = [p for p in Path(local_backend.url).iterdir() if p.suffix == ".distcp"]
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with raises_through_dcp(CorruptCheckpointError) as raised:
        load({"w": torch.zeros(1 << 16)}, local_backend)
    assert str(data_file) in str(raised.value)


def test_an_unknown_transform_is_reported_with_its_file_and_descriptor(local_backend: Backend) -> None:
    save({"w": torch.randn(64)}, local_backend, _extensions=[Rot13Example()])
    with raises_through_dcp(CorruptCheckpointError) as raised:
        load({"w": torch.zeros(64)}, local_backend)  # torch's default registry: no rot13
    assert "stream.rot13/1" in str(raised.value) and local_backend.url in str(raised.value)


@needs_zstd
def test_loading_zstd_without_the_package_says_what_to_install(
    local_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    save({"w": torch.randn(64)}, local_backend, compression="zstd")
    monkeypatch.setattr(torch_extension, "zstandard", None)
    monkeypatch.setattr(torch_extension, "pyzstd", None)
    with raises_through_dcp(MissingDriverError) as raised:
        load({"w": torch.zeros(64)}, local_backend)
    assert "dcp-fsspec[zstd]" in str(raised.value) and local_backend.url in str(raised.value)


def test_an_extension_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(TypeError, match="StreamTransformExtension"):
        FsspecStorageWriter("memory://x", _extensions=[object()])  # type: ignore[list-item]


@needs_zstd
def test_bad_compression_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="'lz4' is not supported"):
        FsspecStorageWriter("memory://x", settings=WriterSettings(compression="lz4"))
    with pytest.raises(ValueError, match="needs compression='zstd'"):
        FsspecStorageWriter("memory://x", settings=WriterSettings(compression_level=3))
    with pytest.raises(ValueError, match="compression_level must be"):
        FsspecStorageWriter("memory://x", settings=WriterSettings(compression="zstd", compression_level=99))


# --- the Checkpointer -------------------------------------------------------------------------


@needs_zstd
def test_checkpointer_compression_round_trips_bit_exact(backend: Backend) -> None:
    state = sample_state()
    with Checkpointer(
        backend.url,
        backend.storage_options,
        writer_settings=WriterSettings(compression="zstd", compression_level=3),
    ) as ckpt:
        ckpt.save(10, model=state, trainer={"step": 10})
    target = empty_like_state(state)
    with Checkpointer(backend.url, backend.storage_options) as ckpt:
        assert ckpt.load(model=target) == 10
    assert_state_equal(target, state)
    raw = backend.fs.cat_file(backend.fs._strip_protocol(backend.sub("iter_000000010", "model", ".metadata")))
    descriptors = {tuple(d or ()) for d in _descriptors(pickle.loads(raw)).values()}
    assert descriptors == {("stream.zstd/1",)}


@needs_zstd
def test_torch_loads_a_key_the_compressing_checkpointer_saved(local_backend: Backend) -> None:
    state = {"w": torch.randn(300, 7), "b": torch.arange(9)}
    with Checkpointer(local_backend.url, writer_settings=WriterSettings(compression="zstd")) as ckpt:
        ckpt.save(1, model=state)
    target = {"w": torch.zeros(300, 7), "b": torch.zeros(9, dtype=torch.int64)}
    dcp.load(
        target,
        storage_reader=FileSystemReader(Path(local_backend.url, "iter_000000001", "model")),
        no_dist=True,
    )
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])


@needs_zstd
def test_the_planner_gets_every_decompressed_record_on_the_loading_thread(local_backend: Backend) -> None:
    state = {f"w{i}": torch.randn(2048) for i in range(20)}
    save(state, local_backend, compression="zstd")
    seen: set[str] = set()

    class Recording(DefaultLoadPlanner):
        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            seen.add(threading.current_thread().name)
            super().commit_tensor(read_item, tensor)

    target = {k: torch.zeros(2048) for k in state}
    dcp.load(target, storage_reader=FsspecStorageReader(local_backend.url), planner=Recording(), no_dist=True)
    assert seen == {threading.current_thread().name}
    assert all(torch.equal(target[k], v) for k, v in state.items())


@needs_zstd
def test_the_background_process_of_async_saves_compresses_too(local_backend: Backend) -> None:
    state = {"w": torch.randn(256, 64), "b": torch.arange(9)}
    with Checkpointer(
        local_backend.url,
        async_mode="async_with_pinned_mem",
        writer_settings=WriterSettings(compression="zstd", compression_level=1),
    ) as ckpt:
        ckpt.save(2, model=state)
        ckpt.wait()
    metadata = FileSystemReader(Path(local_backend.url, "iter_000000002", "model")).read_metadata()
    assert {tuple(d or ()) for d in _descriptors(metadata).values()} == {("stream.zstd/1",)}
    target = {"w": torch.zeros(256, 64), "b": torch.zeros(9, dtype=torch.int64)}
    with Checkpointer(local_backend.url) as ckpt:
        assert ckpt.load(model=target) == 2
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
