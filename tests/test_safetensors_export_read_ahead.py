"""The export reads the next buffer while it writes this one: still bit-exact, and a failure leaves nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec.errors import StorageError
from dcp_fsspec.storage.backends.local import LocalUpload
from dcp_fsspec.storage.write.writer import FsspecStorageWriter
from dcp_fsspec.tools.safetensors import export
from dcp_fsspec.tools.safetensors.export import export_safetensors

safetensors_torch = pytest.importorskip("safetensors.torch")

_WAIT_S = 10  # how long a test waits for the read it expects; only reached when that read never comes


def _state() -> dict[str, torch.Tensor]:
    """Tensors of 4 KiB or less, and one of 64 KiB that streams in pieces through an 8 KiB budget."""
    torch.manual_seed(0)
    state: dict[str, torch.Tensor] = {f"layers.{i}.weight": torch.randn(16, 64) for i in range(6)}
    state["layers.2.bias"] = torch.randn(64, dtype=torch.bfloat16)
    state["big.weight"] = torch.randn(256, 64)
    state["steps"] = torch.arange(9)
    state["norm.weight"] = torch.randn(64, dtype=torch.float16)
    return state


def _save(tmp_path: Path, state: dict[str, torch.Tensor]) -> str:
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FsspecStorageWriter(url))
    return url


class _Reads:
    """Counts the batch reads (``read_batch``), each one started and finished."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started: list[threading.Event] = [threading.Event() for _ in range(64)]
        self.finished: list[threading.Event] = [threading.Event() for _ in range(64)]
        self.calls = 0
        self.held: int | None = None  # the read that waits for ``release``
        self.release = threading.Event()
        read_batch = export.read_batch

        def counted(*args: Any) -> list[torch.Tensor]:
            number = self.calls
            self.calls += 1
            self.started[number].set()
            if number == self.held:
                self.release.wait(_WAIT_S)
            try:
                return read_batch(*args)
            finally:
                self.finished[number].set()

        monkeypatch.setattr(export, "read_batch", counted)


def _on_write(monkeypatch: pytest.MonkeyPatch, after: Any) -> None:
    """Run ``after(n)`` after the n-th write of tensor bytes (from 0) to any local upload."""
    write = LocalUpload.write
    count = [0]

    def counted(self: LocalUpload, buffers: Iterable[bytes | memoryview]) -> None:
        write(self, buffers)
        if self.size > 8 * 1024:  # past the shard's header
            count[0] += 1
            after(count[0] - 1)

    monkeypatch.setattr(LocalUpload, "write", counted)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored-dtypes", "cast-to-bf16"])
def test_an_export_whose_shard_spans_many_buffers_is_bit_exact(
    tmp_path: Path, dtype: torch.dtype | None
) -> None:
    state = _state()
    out = tmp_path / "hf"
    result = export_safetensors(_save(tmp_path, state), out, dtype=dtype, buffer_bytes=8192)
    assert len(result.shards) == 1
    loaded = safetensors_torch.load_file(str(out / result.shards[0]))
    assert sorted(loaded) == sorted(state)
    for name, tensor in state.items():
        want = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name


def test_the_next_batch_is_read_while_this_one_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"layers.{i}.weight": torch.full((32, 64), float(i)) for i in range(5)}  # 8 KiB each
    src = _save(tmp_path, state)
    reads = _Reads(monkeypatch)
    read_during_write: list[bool] = []

    def check(n: int) -> None:
        if n == 0:  # writing batch 0: batch 1's read has started
            read_during_write.append(reads.started[1].wait(_WAIT_S))

    _on_write(monkeypatch, check)
    export_safetensors(src, tmp_path / "hf", buffer_bytes=2 * 8192)  # one tensor per half
    assert read_during_write == [True] and reads.calls == len(state)


def test_a_write_failing_while_the_next_batch_is_read_raises_naming_the_shard_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"layers.{i}.weight": torch.full((32, 64), float(i)) for i in range(5)}  # 8 KiB each
    src = _save(tmp_path, state)
    reads = _Reads(monkeypatch)
    reads.held = 2  # batch 2's read is in flight until the write of batch 1 fails
    seen: list[bool] = []

    def fail(n: int) -> None:
        if n == 1:
            seen.append(reads.started[2].wait(_WAIT_S))
            reads.release.set()
            raise OSError(28, "No space left on device")

    _on_write(monkeypatch, fail)
    out = tmp_path / "hf"
    with pytest.raises(StorageError) as info:
        export_safetensors(src, out, buffer_bytes=2 * 8192)
    assert "model-00001-of-00001.safetensors" in str(info.value) and str(out) in str(info.value)
    assert seen == [True]
    assert reads.finished[2].is_set(), "the export returned while its read-ahead still ran"
    assert reads.calls == 3, "the export read on after its write failed"
    assert not out.exists()


def test_a_read_failing_while_this_batch_is_written_raises_it_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_fsspec.errors import CorruptCheckpointError

    state = {f"layers.{i}.weight": torch.full((32, 64), float(i)) for i in range(5)}
    src = _save(tmp_path, state)
    read_batch = export.read_batch
    calls = [0]

    def failing(reader: Any, metadata: Any, batch: Any, url: str) -> list[torch.Tensor]:
        calls[0] += 1
        if calls[0] == 3:
            raise CorruptCheckpointError(f"{src} is damaged; restore it")
        return read_batch(reader, metadata, batch, url)

    monkeypatch.setattr(export, "read_batch", failing)
    out = tmp_path / "hf"
    with pytest.raises(CorruptCheckpointError, match=src):
        export_safetensors(src, out, buffer_bytes=2 * 8192)
    assert not out.exists()


def test_a_write_failing_while_a_big_tensor_streams_in_pieces_raises_naming_the_shard_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    src = _save(tmp_path, {"big.weight": torch.randn(256, 64)})  # 64 KiB: sixteen 4 KiB pieces

    def fail(n: int) -> None:
        if n == 5:
            raise OSError(28, "No space left on device")

    _on_write(monkeypatch, fail)
    out = tmp_path / "hf"
    with pytest.raises(StorageError) as info:
        export_safetensors(src, out, buffer_bytes=8192)
    assert "model-00001-of-00001.safetensors" in str(info.value) and str(out) in str(info.value)
    assert not out.exists()


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_a_small_batch_holds_only_its_own_bytes_zeroed_of_its_mapped_buffer() -> None:
    """Two buffers are held at once: a batch's buffer must not cost the whole mapping floor."""
    from dcp_fsspec.tools.safetensors.batches import Entry, carve

    batch = [Entry("w", "w", (256, 1024), torch.float32, torch.bfloat16)]  # 1 MiB, cast into 0.5 MiB
    before = _rss_bytes()
    sources, outputs = carve(batch)
    grew = _rss_bytes() - before
    assert grew < 8 * 2**20, f"carving a 1.5 MiB batch grew the RSS by {grew / 2**20:.0f} MiB"
    assert not sources[0].any() and not outputs[0].any()
