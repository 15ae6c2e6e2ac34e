"""The shared round-trip suite: every test runs on every backend in conftest (local, memory, S3)."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_fsspec import CheckpointExistsError, FsspecStorageReader, FsspecStorageWriter, ReaderSettings
from dcp_fsspec.storage.read import reader as reader_module
from tests.conftest import Backend
from tests.helpers import load, raises_through_dcp, save
from tests.states import assert_state_equal, empty_like_state, sample_state


def test_round_trip_restores_every_entry_bitwise(backend: Backend) -> None:
    state = sample_state()
    save(state, backend)
    loaded = load(empty_like_state(state), backend)
    assert_state_equal(loaded, state)


def test_checkpoint_is_data_files_plus_metadata(backend: Backend) -> None:
    save(sample_state(), backend, files_per_rank=4)
    names = sorted(
        p.rsplit("/", 1)[-1] for p in backend.fs.ls(backend.fs._strip_protocol(backend.url), detail=False)
    )
    assert names[0] == ".metadata"
    assert names[1:] and all(n.startswith("__0_") and n.endswith(".distcp") for n in names[1:])


def test_large_state_is_spread_over_several_files_that_all_load(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(9 * 1024 * 1024, generator=gen) for i in range(4)}  # 4 × 36 MiB
    save(state, backend, files_per_rank=4, part_size=5 * 1024 * 1024, max_inflight_bytes=16 * 1024 * 1024)
    data_files = [
        p
        for p in backend.fs.ls(backend.fs._strip_protocol(backend.url), detail=False)
        if p.endswith(".distcp")
    ]
    assert len(data_files) == 4
    loaded = load(
        empty_like_state(state), backend, window_bytes=8 * 1024 * 1024, max_request_bytes=3 * 1024 * 1024
    )
    assert_state_equal(loaded, state)


def test_reset_with_checkpoint_id_writes_to_that_url(backend: Backend) -> None:
    state = {"w": torch.arange(10.0)}
    writer = FsspecStorageWriter(backend.sub("first"), storage_options=backend.storage_options)
    dcp.save(state, checkpoint_id=backend.sub("second"), storage_writer=writer, no_dist=True)
    assert backend.fs.exists(backend.fs._strip_protocol(backend.sub("second", ".metadata")))
    assert not backend.fs.exists(backend.fs._strip_protocol(backend.sub("first", ".metadata")))
    reader = FsspecStorageReader(backend.sub("elsewhere"), storage_options=backend.storage_options)
    target = {"w": torch.zeros(10)}
    dcp.load(target, checkpoint_id=backend.sub("second"), storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], state["w"])


def test_saving_over_a_committed_checkpoint_raises_without_overwrite(backend: Backend) -> None:
    save({"w": torch.ones(3)}, backend)
    with raises_through_dcp(CheckpointExistsError) as raised:
        save({"w": torch.zeros(3)}, backend, overwrite=False)
    assert backend.url in str(raised.value) and "Checkpoint already exists" in str(raised.value)
    assert torch.equal(load({"w": torch.empty(3)}, backend)["w"], torch.ones(3))


def test_overwrite_replaces_the_checkpoint_by_default_as_torch_does(backend: Backend) -> None:
    save({"w": torch.ones(3)}, backend)
    save({"w": torch.full((3,), 7.0)}, backend)
    assert torch.equal(load({"w": torch.empty(3)}, backend)["w"], torch.full((3,), 7.0))


def test_load_of_a_subset_and_of_resized_chunks_reads_what_is_needed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guarantee row: 'ranged reads of the data files' (local, memory, S3, GCS, Azure, SFTP)"""
    state = sample_state()
    save(state, backend)
    fetched: list[int] = []
    real_fetch = reader_module.fetch_in_order

    def counting(fs: Any, spans: list[Any], **kwargs: Any) -> Any:
        fetched.extend(span.size for span in spans)
        return real_fetch(fs, spans, **kwargs)

    monkeypatch.setattr(reader_module, "fetch_in_order", counting)
    subset = {"matrix": torch.zeros(257, 129), "small": {"t4": torch.zeros(5)}}
    loaded = load(subset, backend)
    assert torch.equal(loaded["matrix"], state["matrix"])
    assert torch.equal(loaded["small"]["t4"], state["small"]["t4"])
    storage = (
        FsspecStorageReader(backend.url, storage_options=backend.storage_options).read_metadata().storage_data
    )
    needed = sum(info.length for index, info in storage.items() if index.fqn in ("matrix", "small.t4"))
    everything = sum(info.length for info in storage.values())
    gap = ReaderSettings().max_gap_bytes
    # The two records, and at most a gap's worth of neighbours per request: not the whole files.
    assert needed <= sum(fetched) <= needed + gap * len(fetched) < everything
    assert len(fetched) <= 2


def test_loading_without_checksum_verification_gives_the_same_state(backend: Backend) -> None:
    state = sample_state()
    save(state, backend, checksums=False)
    assert_state_equal(load(empty_like_state(state), backend, verify_checksums=False), state)
    assert_state_equal(load(empty_like_state(state), backend), state)


@pytest.fixture
def one_rank_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real (gloo, world of 1) process group; DCP's process executor needs one."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the executor's own store: loopback only
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("executor", [AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS])
def test_async_save_lands_a_loadable_checkpoint(
    backend: Backend, executor: AsyncCheckpointerType, one_rank_group: None
) -> None:
    if executor is AsyncCheckpointerType.PROCESS and not backend.shared_between_processes:
        pytest.skip("memory:// lives in one process; a background process cannot write to it")
    state = sample_state()
    writer = FsspecStorageWriter(backend.url, storage_options=backend.storage_options)
    response = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=executor)
    future = getattr(response, "upload_completion", response)
    future.result(timeout=240)
    assert_state_equal(load(empty_like_state(state), backend), state)


def test_the_backend_lists_and_reads_small_files_as_its_fsspec_filesystem_does(backend: Backend) -> None:
    """``Backend.find`` and ``read_versioned`` answer as fsspec's ``find``/``cat_file`` would
    (local disk answers with os calls of its own): every file with its size, folders with
    ``withdirs``, nothing for a missing path, and ``None`` for a missing file."""
    from dcp_fsspec.storage.transport.urls import resolve

    where = resolve(backend.url, backend.storage_options)
    files = {
        "iter_1/.commit.json": b"{}",
        "iter_1/model/.metadata": b"m" * 7,
        "iter_1/model/__0_0.distcp": b"d" * 1000,
    }
    for name, data in files.items():
        path = where.join(*name.split("/"))
        where.backend.make_folder(posixpath.dirname(path))
        where.fs.pipe_file(path, data)
    folder = where.join("iter_1")
    expected = {path: info["size"] for path, info in where.fs.find(folder, detail=True).items()}
    found = where.backend.find(folder)
    assert {path: info["size"] for path, info in found.items()} == expected
    assert sorted(found) == sorted(where.join(name) for name in files)
    with_dirs = where.backend.find(where.path, withdirs=True)
    assert set(found) < set(with_dirs)
    if where.backend.real_folders:
        assert with_dirs[where.join("iter_1", "model")]["type"] == "directory"
    assert where.backend.find(where.join("nothing_here")) == {}
    assert where.backend.read_versioned(where.join("iter_1", "model", ".metadata")).data == b"m" * 7
    assert where.backend.read_versioned(where.join("iter_1", "absent")).data is None


def test_local_listing_shows_links_without_following_them_and_raises_on_an_unreadable_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link in a checkpoint folder cannot lead the listing elsewhere, nor round in a loop; a
    folder it cannot read is an error, never an empty folder (retention would act on it)."""
    import os

    from dcp_fsspec.errors import StorageError
    from dcp_fsspec.storage.transport.urls import resolve

    (tmp_path / "run" / "iter_1" / "model").mkdir(parents=True)
    (tmp_path / "run" / "iter_1" / "model" / ".metadata").write_bytes(b"m")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"s" * 10)
    (tmp_path / "run" / "iter_1" / "elsewhere").symlink_to(tmp_path / "outside")
    (tmp_path / "run" / "iter_1" / "loop").symlink_to(tmp_path / "run")
    (tmp_path / "run" / "iter_1" / "model" / "data").write_bytes(b"d" * 3)
    (tmp_path / "run" / "iter_1" / "model" / "linked").symlink_to(
        tmp_path / "run" / "iter_1" / "model" / "data"
    )
    where = resolve(str(tmp_path / "run"))
    found = where.backend.find(where.path)
    assert not any("secret" in path for path in found)
    assert found[where.join("iter_1", "elsewhere")]["type"] == "other"
    assert found[where.join("iter_1", "loop")]["type"] == "other"
    fsspec_found = LocalFileSystem().find(where.path, detail=True)
    assert {p: i["size"] for p, i in found.items()} == {p: i["size"] for p, i in fsspec_found.items()}
    assert found[where.join("iter_1", "model", "linked")]["size"] == 3  # the target's, as fsspec says

    # save_dirname itself may be a link to a folder on another disk: it is walked.
    (tmp_path / "ckpt").symlink_to(tmp_path / "run")
    linked = resolve(str(tmp_path / "ckpt"))
    assert sorted(p.split("/ckpt/", 1)[1] for p in linked.backend.find(linked.path)) == sorted(
        p.split("/run/", 1)[1] for p in found
    )

    real_scandir = os.scandir

    def unreadable(path: Any) -> Any:
        if str(path).endswith("model"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", unreadable)
    with pytest.raises(StorageError, match="cannot list .*run"):
        where.backend.find(where.path)


def test_local_listing_leaves_out_only_what_disappears_during_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention's thread deletes old iterations while a save lists ``save_dirname``: an entry
    gone between the folder's read and its stat is left out, and nothing else with it."""
    import os

    from dcp_fsspec.storage.transport.urls import resolve

    for i in range(1, 4):
        (tmp_path / "run" / f"iter_{i}").mkdir(parents=True)
        (tmp_path / "run" / f"iter_{i}" / ".commit.json").write_bytes(b"{}")
    real_scandir = os.scandir

    class Listed(list):  # what scandir read, usable as scandir's iterator is (with, for)
        def __enter__(self) -> Listed:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    gone: list[str] = []

    def racing(path: Any) -> Any:
        entries = Listed(real_scandir(path))
        if str(path).endswith("run"):
            gone.append(entries[0].name)  # the first listed: the others come after it
            (tmp_path / "run" / gone[0] / ".commit.json").unlink()
            (tmp_path / "run" / gone[0]).rmdir()  # listed, then deleted before its stat
        return entries

    monkeypatch.setattr(os, "scandir", racing)
    where = resolve(str(tmp_path / "run"))
    found = where.backend.find(where.path, withdirs=True)
    kept = sorted({"iter_1", "iter_2", "iter_3"} - set(gone))
    assert len(kept) == 2
    assert sorted(p.rsplit("/run", 1)[1] for p in found) == [
        "",
        *(f"/{i}{end}" for i in kept for end in ("", "/.commit.json")),
    ]
