"""torch_checkpointing's ``CheckpointManager`` saving and loading through :class:`FsspecStorage`.

The real package: a bit-exact round trip on local disk, memory://, moto S3, the GCS emulator and
Azurite; on S3 a crash between staging and commit, the marker commit, an async save from their
writer process, and retention, listing and the latest-step lookup through our storage alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import import_or_skip

import_or_skip(
    "torch_checkpointing",
    "the [torch-checkpointing] extra is not installed: pip install 'dcp-fsspec[torch-checkpointing]'",
)

from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.base_storage import ReadArgs

from dcp_fsspec.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UsageError,
)
from dcp_fsspec.integrations.torch_checkpointing import FsspecStorage, FsspecStorageConfig, commit_by_marker
from tests.ckpt_helpers import assert_equal
from tests.conftest import Backend


class Crash(RuntimeError):
    """The failure injected between staging and commit."""


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 33, generator=g), "h": torch.randn(7, generator=g).to(torch.bfloat16)},
        "optim": {"step": torch.tensor(seed), "m": torch.randn(64, 33, generator=g)},
        "step": seed,
    }


def _empty() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64, 33), "h": torch.zeros(7, dtype=torch.bfloat16)},
        "optim": {"step": torch.tensor(0), "m": torch.zeros(64, 33)},
        "step": 0,
    }


def _manager(
    backend: Backend, *, crash: bool = False, marker: bool = False, **settings: Any
) -> CheckpointManager:
    """A synchronous manager on ``backend``; with ``crash``, each save fails before its commit;
    with ``marker``, steps are committed by a marker file."""
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = FsspecStorageConfig(
        url=backend.url, storage_options=backend.storage_options, **settings
    )
    if crash:
        config.pre_finalize_callback = _crash
    return (commit_by_marker(config) if marker else config).build()


def _storage(backend: Backend) -> FsspecStorage:
    return FsspecStorage(FsspecStorageConfig(url=backend.url, storage_options=backend.storage_options))


def _save(backend: Backend, step: int, **options: Any) -> None:
    """Save ``_state(step)`` as ``step_<step>`` with a manager of its own (see ``_manager``)."""
    manager = _manager(backend, **options)
    try:
        manager.save(f"step_{step}", _state(step))
    finally:
        manager.close()


def _assert_loads(backend: Backend, step: int, **options: Any) -> None:
    manager = _manager(backend, **options)
    try:
        assert_equal(dict(manager.load(f"step_{step}", into=_empty())), _state(step))
    finally:
        manager.close()


def _crash(args: Any) -> None:
    raise Crash(f"injected before the commit of {args.path}")


@pytest.fixture(params=["local", "memory", "s3", "gcs", "azure"])
def tc_backend(request: pytest.FixtureRequest) -> Backend:
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    return backend


def test_a_saved_step_loads_back_bit_exact(tc_backend: Backend) -> None:
    manager = _manager(tc_backend, part_size=4096)  # several parts and ranged reads per file
    try:
        manager.save("step_1", _state(1))
        loaded = manager.load("step_1", into=_empty())
    finally:
        manager.close()
    assert_equal(dict(loaded), _state(1))
    storage = _storage(tc_backend)
    assert storage.ls(Path("")) == ["step_1"]


def test_a_crash_between_staging_and_commit_leaves_the_previous_step_loadable(s3_backend: Backend) -> None:
    _save(s3_backend, 1)
    with pytest.raises(Crash, match="tmp_step_2"):
        _save(s3_backend, 2, crash=True)
    storage = _storage(s3_backend)
    assert not storage.exists(Path("step_2")) and storage.exists(Path("tmp_step_2"))
    _assert_loads(s3_backend, 1)


def test_retention_listing_and_the_latest_step_work_through_the_storage_on_s3(s3_backend: Backend) -> None:
    manager = _manager(s3_backend)
    storage = _storage(s3_backend)
    try:
        for step in (1, 2, 3):
            manager.save(f"step_{step}", _state(step))
        steps = sorted(storage.glob("step_*"), key=lambda name: int(name.split("_")[1]))
        assert steps == ["step_1", "step_2", "step_3"]
        for old in steps[:-2]:  # keep the last two
            storage.rmdir(Path(old))
        assert storage.ls(Path("")) == ["step_2", "step_3"]
        assert storage.isdir(Path("step_3")) and not storage.isdir(Path("step_1"))
        assert_equal(dict(manager.load(steps[-1], into=_empty())), _state(3))
    finally:
        manager.close()


def test_a_folder_rename_never_overwrites_a_committed_step_and_names_its_url(s3_backend: Backend) -> None:
    manager = _manager(s3_backend)
    try:
        manager.save("step_1", _state(1))
        manager.save("step_2", _state(2))
    finally:
        manager.close()
    storage = _storage(s3_backend)
    with pytest.raises(CheckpointExistsError, match=f"{s3_backend.url}/step_2"):
        storage.rename(Path("step_1"), Path("step_2"), is_directory=True)
    assert storage.exists(Path("step_1"))


def test_a_folder_rename_on_s3_moves_every_file_and_removes_the_source(s3_backend: Backend) -> None:
    storage = _storage(s3_backend)
    storage.write(Path("tmp_step_9/model_0.pt"), b"weights")
    storage.write(Path("tmp_step_9/metadata.pkl"), b"metadata")
    storage.rename(Path("tmp_step_9"), Path("step_9"), is_directory=True)
    assert storage.ls(Path("step_9")) == ["metadata.pkl", "model_0.pt"]
    assert storage.read(Path("step_9/model_0.pt")) == b"weights"
    assert not storage.exists(Path("tmp_step_9"))


def test_a_missing_file_is_not_found_naming_its_url(tc_backend: Backend) -> None:
    storage = _storage(tc_backend)
    storage.mkdir(Path(""))
    with pytest.raises(CheckpointNotFoundError, match=f"{tc_backend.url}/step_7/model_0.pt"):
        storage.read(Path("step_7/model_0.pt"))


def test_a_path_outside_the_url_is_refused_naming_the_url(local_backend: Backend) -> None:
    storage = FsspecStorage(FsspecStorageConfig(url=local_backend.url))
    with pytest.raises(UsageError, match=local_backend.url):
        storage.exists(Path("/elsewhere/step_1"))


@pytest.mark.parametrize("marker", [False, True], ids=["rename", "marker"])
def test_an_async_save_writes_from_their_background_process_to_s3(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch, marker: bool
) -> None:
    monkeypatch.setenv("MKL_SERVICE_FORCE_INTEL", "GNU")  # their process sets it in ours; undone after
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = FsspecStorageConfig(
        url=s3_backend.url, storage_options=s3_backend.storage_options
    )
    manager = (commit_by_marker(config) if marker else config).build()
    try:
        written = manager.save("step_5", _state(5))
        assert written is not None
        written.result(timeout=300)
        assert_equal(dict(manager.load("step_5", into=_empty())), _state(5))
    finally:
        manager.close()
    storage = _storage(s3_backend)
    assert storage.is_committed(Path("step_5")) == marker


def test_a_checkpoint_id_may_be_the_full_url_below_the_root(s3_backend: Backend) -> None:
    manager = _manager(s3_backend)
    try:
        manager.save(f"{s3_backend.url}/step_4", _state(4))
        assert_equal(dict(manager.load("step_4", into=_empty())), _state(4))
    finally:
        manager.close()


def test_a_file_rename_replaces_the_file_and_refuses_a_folder_naming_it(s3_backend: Backend) -> None:
    storage = _storage(s3_backend)
    storage.write(Path("new.json"), b"new")
    storage.write(Path("index.json"), b"old")
    storage.write(Path("step_1/model_0.pt"), b"weights")
    storage.rename(Path("new.json"), Path("index.json"))
    assert storage.read(Path("index.json")) == b"new" and not storage.exists(Path("new.json"))
    with pytest.raises(CheckpointExistsError, match=f"{s3_backend.url}/step_1"):
        storage.rename(Path("index.json"), Path("step_1"))


def test_a_marker_commit_copies_nothing_and_a_crash_leaves_the_step_uncommitted(s3_backend: Backend) -> None:
    _save(s3_backend, 1, marker=True)
    with pytest.raises(Crash, match="step_2"):
        _save(s3_backend, 2, marker=True, crash=True)
    storage = _storage(s3_backend)
    assert storage.ls(Path("")) == ["step_1", "step_2"]  # written in place: no staging folder
    assert storage.is_committed(Path("step_1")) and not storage.is_committed(Path("step_2"))
    _assert_loads(s3_backend, 1)


def test_a_file_shorter_than_its_stated_size_is_corrupt_naming_its_url(local_backend: Backend) -> None:
    storage = FsspecStorage(FsspecStorageConfig(url=local_backend.url, part_size=4))
    storage.mkdir(Path("step_1"))
    storage.write(Path("step_1/model_0.pt"), b"0123456789")
    with pytest.raises(CorruptCheckpointError, match=f"{local_backend.url}/step_1/model_0.pt"):
        storage.stream_read(Path("step_1/model_0.pt"), ReadArgs(known_size_bytes=11))


def test_a_step_whose_save_died_before_its_marker_is_neither_listed_nor_loaded(s3_backend: Backend) -> None:
    _save(s3_backend, 1, marker=True)
    with pytest.raises(Crash, match="step_2"):
        _save(s3_backend, 2, marker=True, crash=True)
    storage = FsspecStorage(
        FsspecStorageConfig(
            url=s3_backend.url, storage_options=s3_backend.storage_options, commit_marker=True
        )
    )
    assert storage.ls(Path("")) == ["step_1"]
    assert storage.glob("step_*") == ["step_1"]  # a latest-step lookup sees only committed steps
    manager = _manager(s3_backend, marker=True)
    try:
        with pytest.raises(
            CheckpointNotFoundError, match=f"{s3_backend.url}/step_2 has no .committed marker"
        ):
            manager.load("step_2", into=_empty())
    finally:
        manager.close()
    _assert_loads(s3_backend, 1, marker=True)


def test_commit_by_marker_refuses_a_storage_config_that_cannot_check_the_marker_naming_the_option() -> None:
    config = CheckpointManager.Config.with_sync_save()
    with pytest.raises(UsageError, match="storage_config"):
        commit_by_marker(config)


class _Training:
    """A small AdamW run whose every step sees the same batch, resumed or not."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 4)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train(self, first: int, last: int, manager: CheckpointManager | None = None) -> None:
        """Steps ``first`` to ``last``; with ``manager``, a save after each even step."""
        for step in range(first, last + 1):
            batch = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            self.model(batch).square().mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            if manager is not None and step % 2 == 0:
                model_state, optim_state = get_state_dict(self.model, self.optimizer)
                manager.save(f"step_{step}", {"model": model_state, "optim": optim_state})

    def resume(self, manager: CheckpointManager, step: int) -> None:
        """Load ``step`` as docs/torch-checkpointing.md does: into get_state_dict's templates."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        restored = manager.load(f"step_{step}", into={"model": model_state, "optim": optim_state})
        set_state_dict(
            self.model, self.optimizer, model_state_dict=restored["model"], optim_state_dict=restored["optim"]
        )

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


@pytest.mark.parametrize("marker", [False, True], ids=["rename", "marker"])
def test_training_resumed_through_their_manager_ends_where_a_run_never_stopped_ends(
    tc_backend: Backend, marker: bool
) -> None:
    never_stopped = _Training()
    never_stopped.train(1, 8)
    first = _Training()
    manager = _manager(tc_backend, marker=marker)
    try:
        first.train(1, 5, manager)  # stops after step 5; step_4 is the latest save
    finally:
        manager.close()
    resumed = _Training()
    manager = _manager(tc_backend, marker=marker)
    try:
        resumed.resume(manager, 4)
        resumed.train(5, 8)
    finally:
        manager.close()
    assert resumed.optimizer.state_dict()["state"][0]["exp_avg"].abs().sum() > 0
    assert_equal(resumed.state(), never_stopped.state())


def test_a_fresh_optimizers_own_state_dict_as_the_target_restores_no_moments(local_backend: Backend) -> None:
    """Why the recipe loads into get_state_dict's templates: their load fills only the entries the
    target already has, and a fresh optimizer's state_dict() has none."""
    trained = _Training()
    trained.train(1, 2)
    manager = _manager(local_backend)
    try:
        manager.save("step_2", {"optim": trained.optimizer.state_dict()})
        fresh = _Training()
        restored = manager.load("step_2", into={"optim": fresh.optimizer.state_dict()})
    finally:
        manager.close()
    assert trained.optimizer.state_dict()["state"] and not restored["optim"]["state"]
