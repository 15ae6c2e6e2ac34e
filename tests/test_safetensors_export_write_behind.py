"""A local export hands each batch it wrote to the disk as it goes: every byte once, the shard bit-exact."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec.storage.write.writer import FsspecStorageWriter
from dcp_fsspec.tools.safetensors.export import export_safetensors

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")


def _saved(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    state = {f"layers.{i}.weight": torch.full((32, 64), float(i)) for i in range(5)}  # 8 KiB each
    state["norm.weight"] = torch.randn(64, dtype=torch.bfloat16)
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FsspecStorageWriter(url))
    return url, state


class _Advice:
    """Every ``posix_fadvise`` call, with the inode of the file it named; each one still made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, int, int]] = []  # inode, offset, length, advice
        advise = os.posix_fadvise

        def recorded(fd: int, offset: int, length: int, advice: int) -> None:
            self.calls.append((os.fstat(fd).st_ino, offset, length, advice))
            advise(fd, offset, length, advice)

        monkeypatch.setattr(os, "posix_fadvise", recorded)


def test_every_batch_written_to_a_local_shard_is_handed_to_the_disk_as_the_export_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, state = _saved(tmp_path)
    advice = _Advice(monkeypatch)
    out = tmp_path / "hf"
    result = export_safetensors(src, out, buffer_bytes=2 * 8192)  # one tensor per batch
    shard = out / result.shards[0]
    loaded = safetensors_torch.load_file(str(shard))
    assert sorted(loaded) == sorted(state)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    calls = [c for c in advice.calls if c[0] == shard.stat().st_ino]
    assert len(calls) == len(state), "not one hand-over per batch written"
    assert all(a == os.POSIX_FADV_DONTNEED for _, _, _, a in calls)
    # Each range starts where the one before it did, so bytes still buffered are handed over
    # next time; together they cover the whole file.
    ends = [offset + length for _, offset, length, _ in calls]
    assert calls[0][1] == 0 and ends[-1] == shard.stat().st_size
    assert all(calls[i][1] <= ends[i - 1] for i in range(1, len(calls))) and ends == sorted(ends)


def test_an_export_to_memory_advises_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, state = _saved(tmp_path)
    advice = _Advice(monkeypatch)
    out = f"memory://write-behind-{uuid.uuid4().hex}/hf"
    try:
        result = export_safetensors(src, out, buffer_bytes=2 * 8192)
        assert len(result.shards) == 1
    finally:
        fsspec.filesystem("memory").rm(out.removeprefix("memory://"), recursive=True)
    assert advice.calls == []


def test_a_file_system_that_refuses_the_advice_still_gets_the_whole_shard_and_is_asked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, state = _saved(tmp_path)
    refused: list[int] = []

    def refusing(fd: int, offset: int, length: int, advice: int) -> None:
        refused.append(offset)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refusing)
    out = tmp_path / "hf"
    result = export_safetensors(src, out, buffer_bytes=2 * 8192)
    loaded = safetensors_torch.load_file(str(out / result.shards[0]))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    assert refused == [0], "asked again after the file system refused"
