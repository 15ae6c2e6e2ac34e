"""README claims that had no test of their own: each test names the claim it checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import Checkpointer, FsspecStorageReader, FsspecStorageWriter
from dcp_fsspec.storage import names
from tests.conftest import Backend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_a_ready_filesystem_can_be_passed_as_fs_instead_of_storage_options() -> None:
    """README, the storage layer: "a ready filesystem can be passed as `fs=` instead"."""
    fs = fsspec.filesystem("memory", skip_instance_cache=True)  # a store of its own
    state = {"w": torch.arange(10.0)}
    dcp.save(state, storage_writer=FsspecStorageWriter("memory://given/ckpt", fs=fs), no_dist=True)
    assert fs.exists("/given/ckpt/.metadata")
    back = {"w": torch.zeros(10)}
    dcp.load(back, storage_reader=FsspecStorageReader("memory://given/ckpt", fs=fs), no_dist=True)
    assert torch.equal(back["w"], state["w"])


def test_local_saves_fsync_every_file_before_its_rename_and_then_the_folder(
    local_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guarantees, local disk: "temp name + fsync + rename, folder fsynced" (sync_files=True)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dcp.save({"w": torch.ones(64), "b": torch.zeros(3)}, storage_writer=FsspecStorageWriter(local_backend.url), no_dist=True)
    monkeypatch.undo()
    renames = [(i, *what.split(" -> ")) for i, (kind, what) in enumerate(events) if kind == "replace"]
    assert {os.path.basename(target) for _, _, target in renames} >= {"__0_0.distcp", names.METADATA_NAME}
    for i, temp, target in renames:
        assert ("fsync", temp) in events[:i], f"{temp} renamed to {target} before it was fsynced"
        assert ("fsync", os.path.dirname(target)) in events[i + 1 :], f"the folder of {target} was not fsynced after"


def test_load_path_is_read_with_load_storage_options(s3_backend: Backend, tmp_path: Path) -> None:
    """The Checkpointer: `load_storage_options` are the fsspec options for `load_path`."""
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as source:
        source.save(4, model={"w": torch.full((8,), 4.0)})
    target = {"w": torch.zeros(8)}
    with Checkpointer(
        str(tmp_path / "new-run"),  # local: storage_options would not reach S3
        load_path=s3_backend.sub("iter_000000004"),
        load_storage_options=s3_backend.storage_options,
    ) as ckpt:
        assert ckpt.load(model=target) == 0
    assert torch.equal(target["w"], torch.full((8,), 4.0))


def test_an_async_load_waits_for_the_save_in_flight(local_backend: Backend) -> None:
    """Asynchronous saves: "`load()` waits first too"."""
    with Checkpointer(local_backend.url, async_mode="async_with_pinned_mem") as ckpt:
        ckpt.save(3, trainer={"w": torch.full((1 << 20,), 3.0)})
        target = {"w": torch.zeros(1 << 20)}
        assert ckpt.load(trainer=target) == 3
        assert torch.equal(target["w"], torch.full((1 << 20,), 3.0))


def test_async_saves_with_verify_before_commit_and_retention_commit_and_prune(local_backend: Backend) -> None:
    """Asynchronous saves run the same pipeline: verify_before_commit and keep_last_n included."""
    with Checkpointer(
        local_backend.url, async_mode="async_with_pinned_mem", verify_before_commit=True, keep_last_n=2
    ) as ckpt:
        for iteration in (1, 2, 3):
            ckpt.save(iteration, trainer={"w": torch.full((16,), float(iteration))})
        ckpt.wait()
        assert ckpt.committed_iterations() == [2, 3]
    assert not (Path(local_backend.url) / "iter_000000001").exists()
