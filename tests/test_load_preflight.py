"""A failed load leaves the state untouched: what can be checked is checked before the first byte lands.

Two levels. ``FsspecStorageReader.prepare_local_plan`` checks, on every rank before the plans are
exchanged, that every data file the plan reads is there and long enough (one listing), so
``dcp.load`` with our reader fails before it writes into any target. ``Checkpointer.load``
loads several keys, each its own DCP checkpoint: it checks all of them (metadata, shapes, files)
before it applies the first. Local disk and S3 (moto).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from dcp_fsspec import (
    Checkpointer,
    CheckpointMismatchError,
    CorruptCheckpointError,
    FsspecStorageReader,
    ReaderSettings,
    ResumeOptions,
)
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.helpers import raises_through_dcp, save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DAMAGES = ["delete", "truncate"]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")


def _data_files(backend: Backend, *names: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    fs, folder = fsspec.core.url_to_fs(backend.sub(*names), **backend.storage_options)
    fs.invalidate_cache()
    return fs, sorted(p for p in fs.find(folder) if p.endswith(".distcp"))


def _damage(fs: fsspec.AbstractFileSystem, path: str, damage: str) -> None:
    if damage == "delete":
        fs.rm(path)
    else:
        fs.pipe_file(path, fs.cat_file(path)[:-9])  # cuts into the last record
    fs.invalidate_cache()


def _live(seed: float) -> tuple[nn.Module, dict[str, Any]]:
    model = nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(seed)
    return model, {"step": int(seed), "table": torch.full((32,), seed)}


def _snapshot(model: nn.Module, trainer: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "table": trainer["table"].clone()}


def _assert_untouched(model: nn.Module, trainer: dict[str, Any], before: dict[str, Any]) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, before["model"][name]), f"model.{name} was changed by the failed load"
    assert torch.equal(trainer["table"], before["table"]), "trainer.table was changed by the failed load"


def _save_two_keys(backend: Backend) -> None:
    model, trainer = _live(1.0)
    with Checkpointer(backend.url, backend.storage_options) as ckpt:
        ckpt.save(1, model=model, trainer=trainer)


# -- Checkpointer: every key is checked before the first is applied --------------------------------


def _checkpointer(backend: Backend, via: str) -> Checkpointer:
    if via == "save_dirname":
        return Checkpointer(backend.url, backend.storage_options)
    # A new run starting from that iteration folder, whose commit record is not looked at.
    return Checkpointer(
        backend.sub("new-run"),
        backend.storage_options,
        resume=ResumeOptions(load_path=backend.sub("iter_000000001"), load_training_state=True),
    )


# A file deleted under save_dirname is caught by the commit record's check already (it names
# the files of every key); through load_path, nothing but the preflight sees it.
@pytest.mark.parametrize(
    ("damage", "via"), [("truncate", "save_dirname"), ("truncate", "load_path"), ("delete", "load_path")]
)
def test_a_damaged_data_file_of_the_second_key_leaves_the_first_key_untouched(
    store: Backend, damage: str, via: str
) -> None:
    _save_two_keys(store)
    fs, files = _data_files(store, "iter_000000001", "trainer")
    _damage(fs, files[0], damage)
    model, trainer = _live(7.0)
    before = _snapshot(model, trainer)
    with _checkpointer(store, via) as ckpt, pytest.raises(CorruptCheckpointError) as raised:
        ckpt.load(model=model, trainer=trainer)
    _assert_untouched(model, trainer, before)
    assert store.sub("iter_000000001", "trainer", files[0].rsplit("/", 1)[-1]) in str(raised.value)
    assert "nothing was loaded" in str(raised.value)
    assert trainer["step"] == 7


def test_a_shape_that_does_not_fit_the_second_key_leaves_the_first_key_untouched(store: Backend) -> None:
    _save_two_keys(store)
    model, trainer = _live(7.0)
    trainer["table"] = torch.full((33,), 7.0)
    before = _snapshot(model, trainer)
    with (
        Checkpointer(store.url, store.storage_options) as ckpt,
        pytest.raises(CheckpointMismatchError) as raised,
    ):
        ckpt.load(model=model, trainer=trainer)
    _assert_untouched(model, trainer, before)
    assert "table" in str(raised.value) and store.url in str(raised.value)


def test_damage_only_the_bytes_show_says_which_keys_may_be_partly_loaded(local_backend: Backend) -> None:
    _save_two_keys(local_backend)
    fs, files = _data_files(local_backend, "iter_000000001", "trainer")
    data = bytearray(fs.cat_file(files[0]))
    data[-200] ^= 0xFF  # inside the last record, same size: only its checksum can tell
    fs.pipe_file(files[0], bytes(data))
    model, trainer = _live(7.0)
    with Checkpointer(local_backend.url) as ckpt, pytest.raises(CorruptCheckpointError) as raised:
        ckpt.load(model=model, trainer=trainer)
    assert "keys ['model'] were restored and key 'trainer' may be partly loaded" in str(raised.value)


def test_a_load_reads_no_metadata_twice_and_lists_no_key_folder(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_two_keys(s3_backend)
    sent: Counter[tuple[str, str]] = Counter()
    real = s3fs.S3FileSystem._call_s3

    async def counting(self: s3fs.S3FileSystem, method: str, *args: Any, **kwargs: Any) -> Any:
        sent[(method, str(kwargs.get("Key") or kwargs.get("Prefix") or ""))] += 1
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    model, trainer = _live(7.0)
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        assert ckpt.load(model=model, trainer=trainer) == 1
    for key in ("model", "trainer"):
        folder = f"ckpt/iter_000000001/{key}/"
        # One read, by the token check on rank 0; the preflight and the load parse its bytes.
        assert sent[("get_object", folder + ".metadata")] == 1, sent
        # The preflight checks the data files against the iteration's one listing (sizes
        # included), which the token check made: no key folder is listed, nor a file asked about.
        assert sent[("list_objects_v2", folder)] == 0, sent
        assert not any(method == "head_object" and k.startswith(folder) for method, k in sent), sent
    assert sent[("list_objects_v2", "ckpt/iter_000000001/")] == 1, sent


# -- dcp.load with our reader: the files are checked before any target is written -----------------


def _two_big_tensors(value: float) -> dict[str, torch.Tensor]:
    # 2 MiB each, read in 1 MiB requests: the first arrives (and used to be copied into its
    # target) before the second's are sent.
    return {"a": torch.full((512 * 1024,), value), "b": torch.full((512 * 1024,), value)}


@pytest.mark.parametrize("damage", DAMAGES)
def test_dcp_load_of_a_damaged_data_file_fails_before_any_target_changes(store: Backend, damage: str) -> None:
    save(_two_big_tensors(1.0), store)
    fs, files = _data_files(store)
    _damage(fs, files[0], damage)
    target = _two_big_tensors(0.0)
    reader = FsspecStorageReader(
        store.url,
        storage_options=store.storage_options,
        settings=ReaderSettings(max_request_bytes=1024 * 1024),
    )
    with raises_through_dcp(CorruptCheckpointError) as raised:
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert not target["a"].any() and not target["b"].any(), "a target changed before the error"
    assert files[0].rsplit("/", 1)[-1] in str(raised.value)


def test_dcp_planner_refuses_missing_entries_and_other_shapes_before_reading(store: Backend) -> None:
    # torch's own DefaultLoadPlanner, as of torch 2.13: checked while planning, before read_data.
    save(_two_big_tensors(1.0), store)
    for target, error in (
        ({**_two_big_tensors(0.0), "c": torch.zeros(2)}, "Missing key in checkpoint state_dict: c"),
        ({"a": torch.zeros(512 * 1024), "b": torch.zeros(3)}, "Size mismatch"),
    ):
        reader = FsspecStorageReader(store.url, storage_options=store.storage_options)
        with raises_through_dcp(Exception) as raised:
            dcp.load(target, storage_reader=reader, no_dist=True)
        assert error in str(raised.value)
        assert not target["a"].any()


def test_a_tensor_saved_in_another_dtype_is_converted_into_the_target(local_backend: Backend) -> None:
    save({"w": torch.arange(6, dtype=torch.float32)}, local_backend)
    target = {"w": torch.zeros(6, dtype=torch.float64)}
    dcp.load(target, storage_reader=FsspecStorageReader(local_backend.url), no_dist=True)
    assert target["w"].dtype == torch.float64 and torch.equal(
        target["w"], torch.arange(6, dtype=torch.float64)
    )


# -- several ranks: one rank's failed check fails every rank before any applies a key -------------


def _save_per_rank(rank: int, world_size: int, url: str) -> None:
    # Entries of their own per rank: each rank writes (and later reads) only its own data file.
    with Checkpointer(url) as ckpt:
        ckpt.save(1, model={f"w{rank}": torch.full((8,), 1.0)}, trainer={f"t{rank}": torch.full((8,), 1.0)})


def _load_per_rank(rank: int, world_size: int, url: str, damaged: str) -> None:
    model, trainer = {f"w{rank}": torch.full((8,), 7.0)}, {f"t{rank}": torch.full((8,), 7.0)}
    with Checkpointer(url) as ckpt, pytest.raises(CorruptCheckpointError) as raised:
        ckpt.load(model=model, trainer=trainer)
    assert torch.equal(model[f"w{rank}"], torch.full((8,), 7.0)), f"rank {rank} applied the model"
    assert damaged in str(raised.value), raised.value


def test_a_data_file_only_rank_1_reads_fails_every_rank_before_any_applies_a_key(
    local_backend: Backend, tmp_path: Path
) -> None:
    run_ranks(_save_per_rank, 2, tmp_path, local_backend.url)
    fs, files = _data_files(local_backend, "iter_000000001", "trainer")
    (rank1_file,) = [f for f in files if f.rsplit("/", 1)[-1].startswith("__1_")]
    _damage(fs, rank1_file, "truncate")
    run_ranks(_load_per_rank, 2, tmp_path, local_backend.url, rank1_file.rsplit("/", 1)[-1])
