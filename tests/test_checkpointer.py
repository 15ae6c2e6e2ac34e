"""The Checkpointer in one process: layout, resume rules, commit/pointer rules, retention.

Tests that depend on storage take the ``backend`` fixture (local disk, memory://, S3 on a moto
server); pure argument checks use memory:// only.
"""

from __future__ import annotations

import logging
import os
import posixpath
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from dcp_fsspec import (
    Checkpointer,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FsspecStorageWriter,
    ResumeOptions,
)
from dcp_fsspec.checkpoint.commit import deletion, layout, retention
from dcp_fsspec.checkpoint.commit import run_listing as listing
from dcp_fsspec.checkpoint.save.pipeline import SavePipeline
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME
from dcp_fsspec.storage.transport.urls import resolve
from tests.ckpt_helpers import Training, assert_equal, assert_same_training
from tests.conftest import Backend
from tests.helpers import flip_a_byte_of_each_data_file_once_written

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _ckpt(backend: Backend, **kwargs: Any) -> Checkpointer:
    return Checkpointer(backend.url, backend.storage_options, **kwargs)


def _fs_path(backend: Backend, *names: str, fresh: bool = True) -> tuple[fsspec.AbstractFileSystem, str]:
    """The store's filesystem and the path of ``names`` under the backend's URL.

    ``fresh``: a new driver instance, which sees the store as it is (a cached adlfs instance can
    list what another client deleted); else the instance the library uses, to patch its calls.
    """
    options = {**backend.storage_options, **({"skip_instance_cache": True} if fresh else {})}
    fs, path = fsspec.core.url_to_fs(backend.sub(*names), **options)
    fs.invalidate_cache()
    return fs, path


def _save_trained(backend: Backend, iterations: list[int], **kwargs: Any) -> Training:
    """Train, saving at each of ``iterations`` (ascending); returns the live training."""
    training = Training()
    with _ckpt(backend, **kwargs) as ckpt:
        for iteration in iterations:
            training.run(iteration - training.trainer["step"])
            ckpt.save(iteration, **training.keys())
    return training


# -- layout and round trip ----------------------------------------------------------------------


def test_resumed_training_matches_uninterrupted_training_bitwise(backend: Backend) -> None:
    uninterrupted = Training()
    uninterrupted.run(6)

    first = Training()
    with _ckpt(backend) as ckpt:
        assert ckpt.load(**first.keys()) == 0
        first.run(3)
        ckpt.save(3, **first.keys())
        first.run(1)  # work lost by the "crash"

    resumed = Training(seed=7)  # other weights and data: all must come back from storage
    with _ckpt(backend) as ckpt:
        assert ckpt.load(**resumed.keys()) == 3
        resumed.after_load()
        resumed.run(3)

    assert_same_training(resumed, uninterrupted)
    assert resumed.losses == uninterrupted.losses[3:]


def test_a_save_before_the_first_step_leaves_training_as_it_was_and_resumes_it_bitwise(
    local_backend: Backend,
) -> None:
    uninterrupted = Training()
    uninterrupted.run(3)

    first = Training()
    with _ckpt(local_backend) as ckpt:
        ckpt.save(0, **first.keys())  # torch would take a zero-rate step to read AdamW's state
        assert not first.optim.state
        first.run(3)
    assert_same_training(first, uninterrupted)

    resumed = Training(seed=7)
    with _ckpt(local_backend) as ckpt:
        ckpt.load(**resumed.keys(), iteration=0)
        resumed.after_load()
        resumed.run(3)
    assert_same_training(resumed, uninterrupted)


def test_saved_iteration_has_a_folder_per_key_and_the_pointer_names_it(backend: Backend) -> None:
    _save_trained(backend, [5])
    fs, root = _fs_path(backend)
    folder = posixpath.join(root, "iter_000000005")
    # torch's data file names where one save can claim the folder across processes; elsewhere
    # (GCS, Azure, SFTP) every save puts its token into them, so racing saves never share one.
    fixed = resolve(backend.url, backend.storage_options).backend.exclusive_across_processes
    for key in ("model", "optim", "scheduler", "trainer"):
        names = {posixpath.basename(p) for p in fs.ls(posixpath.join(folder, key), detail=False)}
        data = sorted(n for n in names if n.endswith(".distcp"))
        assert ".metadata" in names and len(data) == 1, names
        assert (data[0] == "__0_0.distcp") == fixed, data
    assert fs.cat_file(posixpath.join(root, "latest_checkpoint.txt")) == b"iter_000000005\n"
    with _ckpt(backend) as ckpt:
        assert ckpt.latest_checkpoint() == "iter_000000005"
        assert ckpt.committed_iterations() == [5]


def test_trainer_dict_is_restored_in_place(memory_backend: Backend) -> None:
    saved = {"step": 4, "rng": torch.arange(5, dtype=torch.uint8), "nested": {"lr": 0.5, "names": ["a", "b"]}}
    with _ckpt(memory_backend) as ckpt:
        ckpt.save(4, trainer=saved)
    target = {"step": 0, "rng": torch.zeros(5, dtype=torch.uint8), "nested": {"lr": 0.0, "names": []}}
    rng_tensor = target["rng"]
    with _ckpt(memory_backend) as ckpt:
        assert ckpt.load(trainer=target) == 4
    assert target["rng"] is rng_tensor  # tensors are copied into, not replaced
    assert_equal(target, saved)


def test_lists_of_modules_and_optimizers_round_trip(memory_backend: Backend) -> None:
    def stages(seed: int) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        torch.manual_seed(seed)
        # Pipeline stages keep their full-model names, so a merged state dict has no clashes.
        first, second = nn.Sequential(nn.Linear(3, 4)), nn.Sequential()
        second.add_module("1", nn.Linear(4, 2))
        modules: list[nn.Module] = [first, second]
        optims: list[torch.optim.Optimizer] = [torch.optim.Adam(m.parameters(), lr=0.1) for m in modules]
        for m, o, width in zip(modules, optims, (3, 4)):
            m(torch.ones(1, width)).sum().backward()
            o.step()
        return modules, optims

    modules, optims = stages(0)
    with _ckpt(memory_backend) as ckpt:
        ckpt.save(1, model=modules, optim=optims)
    restored, restored_optims = stages(1)
    with _ckpt(memory_backend) as ckpt:
        ckpt.load(model=restored, optim=restored_optims)
    for a, b in zip(modules, restored):
        assert_equal(a.state_dict(), b.state_dict())
    for a, b in zip(optims, restored_optims):
        assert_equal(a.state_dict(), b.state_dict())


def test_any_stateful_round_trips(memory_backend: Backend) -> None:
    class Counter:
        def __init__(self, n: int) -> None:
            self.n = n

        def state_dict(self) -> dict[str, Any]:
            return {"n": self.n}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.n = state_dict["n"]

    with _ckpt(memory_backend) as ckpt:
        ckpt.save(2, sampler=Counter(41), samplers=[Counter(1), Counter(2)])
    one, many = Counter(0), [Counter(0), Counter(0)]
    with _ckpt(memory_backend) as ckpt:
        ckpt.load(sampler=one, samplers=many)
    assert (one.n, many[0].n, many[1].n) == (41, 1, 2)


# -- resume rules -------------------------------------------------------------------------------


def test_load_without_checkpoint_or_load_path_starts_from_scratch(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    training = Training()
    before = {k: v.clone() for k, v in training.model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="dcp_fsspec"), _ckpt(backend) as ckpt:
        assert ckpt.load(**training.keys()) == 0
        assert ckpt.latest_checkpoint() is None
    assert_equal(training.model.state_dict(), before)
    assert "from scratch" in caplog.text and backend.url in caplog.text


def test_load_path_loads_only_the_model_and_returns_zero(backend: Backend) -> None:
    source = _save_trained(backend, [4])
    target = Training(seed=3)
    with Checkpointer(
        backend.sub("new_run"),
        backend.storage_options,
        resume=ResumeOptions(load_path=backend.sub("iter_000000004")),
    ) as ckpt:
        assert ckpt.load(**target.keys()) == 0
    assert_equal(target.model.state_dict(), source.model.state_dict())
    assert target.optim.state_dict()["state"] == {}
    assert target.trainer["step"] == 0 and target.trainer["note"] == "seed 3"


def test_load_path_with_training_state_loads_every_key_and_returns_its_iteration(backend: Backend) -> None:
    source = _save_trained(backend, [4])
    target = Training(seed=3)
    with Checkpointer(
        backend.sub("new_run"),
        backend.storage_options,
        resume=ResumeOptions(load_path=backend.sub("iter_000000004"), load_training_state=True),
    ) as ckpt:
        assert ckpt.load(**target.keys()) == 4
    target.after_load()
    assert_same_training(target, source)


def test_load_path_may_be_another_runs_save_dirname(memory_backend: Backend) -> None:
    source = _save_trained(memory_backend, [2, 4])
    target = Training(seed=3)
    with Checkpointer(
        memory_backend.sub("new_run"),
        resume=ResumeOptions(load_path=memory_backend.url, load_training_state=True),
    ) as ckpt:
        assert ckpt.load(**target.keys()) == 4
    target.after_load()
    assert_same_training(target, source)


def test_load_path_may_be_a_single_dcp_checkpoint_of_the_model(backend: Backend) -> None:
    source = Training(seed=5)
    url = backend.sub("weights")
    dcp.save(
        source.model.state_dict(),
        storage_writer=FsspecStorageWriter(url, storage_options=backend.storage_options),
    )
    target = Training()
    with Checkpointer(
        backend.sub("run"), backend.storage_options, resume=ResumeOptions(load_path=url)
    ) as ckpt:
        assert ckpt.load(**target.keys()) == 0
    assert_equal(target.model.state_dict(), source.model.state_dict())


def test_load_path_may_be_a_single_dcp_checkpoint_with_the_model_under_model(backend: Backend) -> None:
    source = Training(seed=5)
    url = backend.sub("rl_weights")
    writer = FsspecStorageWriter(url, storage_options=backend.storage_options)
    dcp.save({"model": source.model.state_dict()}, storage_writer=writer)  # the original trainer's RL layout
    target = Training()
    with Checkpointer(
        backend.sub("run"), backend.storage_options, resume=ResumeOptions(load_path=url)
    ) as ckpt:
        assert ckpt.load(**target.keys()) == 0
    assert_equal(target.model.state_dict(), source.model.state_dict())


def test_only_load_scheduler_state_loads_the_model_and_the_scheduler_and_returns_zero(
    backend: Backend,
) -> None:
    source = _save_trained(backend, [4])
    target = Training(seed=3)
    with Checkpointer(
        backend.sub("new_run"),
        backend.storage_options,
        resume=ResumeOptions(load_path=backend.sub("iter_000000004"), only_load_scheduler_state=True),
    ) as ckpt:
        assert ckpt.load(**target.keys()) == 0
    assert_equal(target.model.state_dict(), source.model.state_dict())
    assert_equal(target.scheduler.state_dict(), source.scheduler.state_dict())
    assert target.scheduler.state_dict()["last_epoch"] == 4
    assert target.optim.state_dict()["state"] == {}
    assert target.trainer["step"] == 0 and target.trainer["note"] == "seed 3"


def test_only_load_scheduler_state_with_load_training_state_is_a_value_error_naming_both(
    memory_backend: Backend,
) -> None:
    with pytest.raises(ValueError) as info:
        _ckpt(
            memory_backend,
            resume=ResumeOptions(
                load_path=memory_backend.sub("old"), load_training_state=True, only_load_scheduler_state=True
            ),
        )
    assert "only_load_scheduler_state" in str(info.value) and "load_training_state" in str(info.value)
    assert memory_backend.sub("old") in str(info.value)


def test_load_path_without_any_checkpoint_is_an_error_naming_it(memory_backend: Backend) -> None:
    url = memory_backend.sub("nothing_here")
    with (
        pytest.raises(CheckpointNotFoundError) as info,
        Checkpointer(memory_backend.sub("run"), resume=ResumeOptions(load_path=url)) as ckpt,
    ):
        ckpt.load(**Training().keys())
    assert url in str(info.value)


def test_pointer_under_save_dirname_wins_over_load_path(memory_backend: Backend) -> None:
    _save_trained(memory_backend, [2])
    run = Checkpointer(
        memory_backend.sub("run"), resume=ResumeOptions(load_path=memory_backend.sub("iter_000000002"))
    )
    later = Training(seed=9)
    later.run(7)
    run.save(7, **later.keys())
    target = Training()
    assert run.load(**target.keys()) == 7
    target.after_load()
    assert_same_training(target, later)


def test_missing_key_with_strict_resume_is_an_error_naming_the_key_and_url(backend: Backend) -> None:
    training = _save_trained(backend, [3])
    with _ckpt(backend) as ckpt:
        with pytest.raises(CheckpointNotFoundError) as info:
            ckpt.load(**training.keys(), ema={"decay": torch.zeros(1)})
    assert "'ema'" in str(info.value) and backend.sub("iter_000000003") in str(info.value)


def test_missing_key_without_strict_resume_is_skipped_and_logged(
    memory_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    source = _save_trained(memory_backend, [3])
    target, ema = Training(seed=2), {"decay": torch.zeros(1)}
    with (
        caplog.at_level(logging.INFO, logger="dcp_fsspec"),
        _ckpt(memory_backend, resume=ResumeOptions(strict=False)) as ckpt,
    ):
        assert ckpt.load(**target.keys(), ema=ema) == 3
    target.after_load()
    assert_same_training(target, source)
    assert torch.equal(ema["decay"], torch.zeros(1))
    assert "'ema'" in caplog.text and memory_backend.url in caplog.text


def test_missing_entry_inside_a_key_is_tolerated_only_without_strict_resume(memory_backend: Backend) -> None:
    with _ckpt(memory_backend) as ckpt:
        ckpt.save(1, trainer={"step": 1})
    with _ckpt(memory_backend) as ckpt, pytest.raises(CheckpointMismatchError) as info:
        ckpt.load(trainer={"step": 0, "added_later": torch.ones(2)})
    assert memory_backend.sub("iter_000000001", "trainer") in str(info.value)
    target = {"step": 0, "added_later": torch.ones(2)}
    with _ckpt(memory_backend, resume=ResumeOptions(strict=False)) as ckpt:
        ckpt.load(trainer=target)
    assert target["step"] == 1 and torch.equal(target["added_later"], torch.ones(2))


def test_shape_mismatch_is_a_checkpoint_mismatch_error_naming_the_url(memory_backend: Backend) -> None:
    with _ckpt(memory_backend) as ckpt:
        ckpt.save(1, model=nn.Linear(3, 4))
    with _ckpt(memory_backend) as ckpt, pytest.raises(CheckpointMismatchError) as info:
        ckpt.load(model=nn.Linear(3, 5))
    assert memory_backend.sub("iter_000000001", "model") in str(info.value)


def test_keys_not_to_resume_are_left_untouched(memory_backend: Backend) -> None:
    source = _save_trained(memory_backend, [3])
    target = Training(seed=2)
    scheduler_before = target.scheduler.state_dict()
    with _ckpt(memory_backend, resume=ResumeOptions(keys_not_to_resume=["scheduler"])) as ckpt:
        assert ckpt.load(**target.keys()) == 3
    assert target.scheduler.state_dict() == scheduler_before
    assert_equal(target.model.state_dict(), source.model.state_dict())
    assert_equal(target.optim.state_dict()["state"], source.optim.state_dict()["state"])


def test_keys_not_to_resume_naming_an_unknown_key_is_a_value_error(memory_backend: Backend) -> None:
    _save_trained(memory_backend, [3])
    with (
        _ckpt(memory_backend, resume=ResumeOptions(keys_not_to_resume=["optimizer"])) as ckpt,
        pytest.raises(ValueError) as info,
    ):
        ckpt.load(**Training().keys())
    assert "'optimizer'" in str(info.value) and memory_backend.url in str(info.value)


def test_load_optimizer_false_leaves_the_optimizer_untouched(memory_backend: Backend) -> None:
    source = _save_trained(memory_backend, [3])
    target = Training(seed=2)
    with _ckpt(memory_backend, resume=ResumeOptions(load_optimizer=False)) as ckpt:
        assert ckpt.load(**target.keys()) == 3
    assert target.optim.state_dict()["state"] == {}
    assert_equal(target.model.state_dict(), source.model.state_dict())
    assert target.trainer["step"] == 3


# -- commit and pointer rules -------------------------------------------------------------------


def test_saving_a_committed_iteration_raises_checkpoint_exists_error_naming_the_folder(
    backend: Backend,
) -> None:
    training = _save_trained(backend, [3])
    with _ckpt(backend) as ckpt, pytest.raises(CheckpointExistsError) as info:
        ckpt.save(3, **training.keys())
    assert backend.sub("iter_000000003") in str(info.value)


def test_overwrite_replaces_a_committed_iteration(memory_backend: Backend) -> None:
    _save_trained(memory_backend, [3])
    other = Training(seed=4)
    with _ckpt(memory_backend, overwrite=True) as ckpt:
        ckpt.save(3, model=other.model)
    target = Training()
    with _ckpt(memory_backend) as ckpt:
        assert ckpt.load(model=target.model) == 3
    assert_equal(target.model.state_dict(), other.model.state_dict())
    fs, root = _fs_path(memory_backend, "iter_000000003")
    assert not fs.exists(posixpath.join(root, "optim"))  # the old keys went with the old save


def test_leftovers_of_an_uncommitted_iteration_are_cleared_and_rewritten(backend: Backend) -> None:
    fs, folder = _fs_path(backend, "iter_000000003")
    fs.makedirs(posixpath.join(folder, "model"), exist_ok=True)
    fs.makedirs(posixpath.join(folder, "optim"), exist_ok=True)
    fs.pipe_file(posixpath.join(folder, "model", ".metadata"), b"half a save")
    fs.pipe_file(posixpath.join(folder, "optim", "__0_0.distcp"), b"half a save")
    with _ckpt(backend) as ckpt:
        assert ckpt.committed_iterations() == []
        training = Training()
        training.run(2)
        ckpt.save(3, **training.keys())
        assert ckpt.committed_iterations() == [3]
    target = Training(seed=1)
    with _ckpt(backend) as ckpt:
        assert ckpt.load(**target.keys()) == 3
    target.after_load()
    assert_same_training(target, training)


def test_iteration_whose_keys_all_finished_is_not_committed_without_its_commit_record(
    memory_backend: Backend,
) -> None:
    _save_trained(memory_backend, [2, 4])
    fs, folder = _fs_path(memory_backend, "iter_000000004")
    fs.rm_file(posixpath.join(folder, COMMIT_RECORD_NAME))  # a crash just before committing
    with _ckpt(memory_backend) as ckpt:
        assert ckpt.committed_iterations() == [2]
        ckpt.save(4, **Training().keys())  # leftovers, not a committed iteration in the way
        assert ckpt.committed_iterations() == [2, 4]


def test_pointer_never_moves_backwards(memory_backend: Backend) -> None:
    training = _save_trained(memory_backend, [10])
    with _ckpt(memory_backend) as ckpt, pytest.raises(CheckpointExistsError) as info:
        ckpt.save(5, **training.keys())
    assert memory_backend.sub("latest_checkpoint.txt") in str(info.value) and "iter_000000010" in str(
        info.value
    )
    with _ckpt(memory_backend, overwrite=True) as ckpt:
        ckpt.save(5, **training.keys())
        assert ckpt.committed_iterations() == [5, 10]
        assert ckpt.latest_checkpoint() == "iter_000000010"


@pytest.mark.parametrize(
    "damage", ["delete the folder", "delete a key's .metadata", "delete the commit record"]
)
def test_pointer_naming_a_missing_or_uncommitted_folder_is_an_error_naming_both(
    backend: Backend, damage: str
) -> None:
    """Guarantee row: 'the pointer names only committed iterations and never moves back' (local, memory, S3, GCS, Azure, SFTP)"""
    _save_trained(backend, [2, 4])
    fs, folder = _fs_path(backend, "iter_000000004")
    if damage == "delete the folder":
        fs.rm(folder, recursive=True)
    elif damage == "delete a key's .metadata":
        fs.rm_file(posixpath.join(folder, "optim", ".metadata"))
    else:
        fs.rm_file(posixpath.join(folder, COMMIT_RECORD_NAME))
    with _ckpt(backend) as ckpt, pytest.raises(CheckpointNotFoundError) as info:
        ckpt.load(**Training().keys())
    assert backend.sub("latest_checkpoint.txt") in str(info.value)
    assert backend.sub("iter_000000004") in str(info.value)


def test_pointer_with_trailing_whitespace_is_accepted(memory_backend: Backend) -> None:
    _save_trained(memory_backend, [4])
    fs, path = _fs_path(memory_backend, "latest_checkpoint.txt")
    fs.pipe_file(path, b"iter_000000004 \r\n\n")
    with _ckpt(memory_backend) as ckpt:
        assert ckpt.latest_checkpoint() == "iter_000000004"
        assert ckpt.load(**Training().keys()) == 4


@pytest.mark.parametrize(
    "content", [b"", b" \n", b"garbage", b"iter_4", b"iter_000000004/model", b"\xff\xfe"]
)
def test_empty_or_garbage_pointer_is_an_error_naming_the_pointer_url(
    backend: Backend, content: bytes
) -> None:
    fs, path = _fs_path(backend, "latest_checkpoint.txt")
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, content)
    with _ckpt(backend) as ckpt:
        with pytest.raises(CorruptCheckpointError) as info:
            ckpt.load(**Training().keys())
        assert backend.sub("latest_checkpoint.txt") in str(info.value)
        with pytest.raises(CorruptCheckpointError):
            ckpt.latest_checkpoint()


def test_pointer_is_renamed_into_place_on_local_disk(
    local_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guarantee row: 'the pointer latest_checkpoint.txt is replaced atomically' (local)"""
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        renames.append((src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    _save_trained(local_backend, [1])
    pointer = os.path.join(local_backend.url, "latest_checkpoint.txt")
    assert [dst for _, dst in renames if dst == pointer] == [pointer]
    src = next(src for src, dst in renames if dst == pointer)
    assert os.path.dirname(src) == local_backend.url and not os.path.exists(src)
    assert sorted(os.listdir(local_backend.url)) == ["iter_000000001", "latest_checkpoint.txt"]


# -- retention ----------------------------------------------------------------------------------


def test_keep_last_n_keeps_the_newest_committed_iterations(backend: Backend) -> None:
    _save_trained(backend, [1, 2, 3, 4], keep_last_n=2)
    fs, root = _fs_path(backend)
    assert sorted(posixpath.basename(p) for p in fs.ls(root, detail=False)) == [
        "iter_000000003",
        "iter_000000004",
        "latest_checkpoint.txt",
    ]


def test_retention_plan_keeps_the_pointer_target_and_iterations_being_written() -> None:
    plan = retention.plan_deletions
    assert plan([1, 2, 3, 4], [1, 2, 3, 4], keep_last_n=1, latest=4) == [1, 2, 3]
    assert plan([1, 2, 3, 4], [1, 2, 3, 4], keep_last_n=1, latest=4, protected=[2]) == [1, 3]
    # The pointer's target is kept even when newer committed iterations exist.
    assert plan([1, 2, 3, 4], [1, 2, 3, 4], keep_last_n=1, latest=2) == [1]
    # Debris older than the pointer goes; newer folders (maybe being written) stay.
    assert plan([1, 2, 3, 5], [1, 3], keep_last_n=2, latest=3) == [2]
    assert plan([1, 2], [1, 2], keep_last_n=1, latest=None) == []


def test_a_failed_delete_is_logged_and_retried_at_the_next_save(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    training = _save_trained(memory_backend, [1])
    fs, root = _fs_path(memory_backend, fresh=False)

    real_rm = fs.rm

    def broken_rm(path: str | list[str], recursive: bool = False, maxdepth: int | None = None) -> None:
        # Deletes come one path at a time or as a list (a bulk delete), a folder whole or file
        # by file: the old iteration's folder and files are refused; its commit record is not.
        paths = [path] if isinstance(path, str) else path
        old = [p for p in paths if "iter_000000001" in p and not p.endswith(COMMIT_RECORD_NAME)]
        if old:
            raise PermissionError(f"denied: {path}")
        real_rm(path, recursive=recursive, maxdepth=maxdepth)

    with _ckpt(memory_backend, keep_last_n=1) as ckpt:
        with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="dcp_fsspec"):
            patch.setattr(fs, "rm", broken_rm)
            training.run(1)
            ckpt.save(2, **training.keys())  # not fatal
            ckpt.wait()  # the old iteration's files are deleted on a thread of their own
        assert "iter_000000001" in caplog.text and "retried" in caplog.text
        assert ckpt.committed_iterations() == [2]  # uncommitted before the data was touched
        assert fs.exists(posixpath.join(root, "iter_000000001"))
        training.run(1)
        ckpt.save(3, **training.keys())
    assert not fs.exists(posixpath.join(root, "iter_000000001"))
    assert not fs.exists(posixpath.join(root, "iter_000000002"))


def test_a_save_returns_before_retention_deleted_the_old_files_and_the_next_save_waits_for_them(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention uncommits the old iteration in the save; its files go on a thread of their
    own (a small local save spent a sixth of its time deleting them). The next save waits for
    that thread: it may write into the folder being deleted."""
    import threading

    purging, release, prepared = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []
    real_remove, real_prepare = deletion.remove_iterations, SavePipeline._prepare

    def held_remove(root: Any, iterations: list[int]) -> None:
        purging.set()
        assert release.wait(30)
        real_remove(root, iterations)
        order.extend(f"deleted {iteration}" for iteration in iterations)

    def noted_prepare(self: SavePipeline, iteration: int, save_id: str) -> Any:
        order.append(f"prepare {iteration}")
        prepared.set()
        return real_prepare(self, iteration, save_id)

    monkeypatch.setattr(deletion, "remove_iterations", held_remove)
    monkeypatch.setattr(SavePipeline, "_prepare", noted_prepare)
    old = tmp_path / "iter_000000001"
    with Checkpointer(str(tmp_path), keep_last_n=1) as ckpt:
        ckpt.save(1, model={"w": torch.ones(4)})
        ckpt.save(2, model={"w": torch.ones(4) * 2})  # returns with the deletion held
        assert purging.wait(30)
        assert ckpt.committed_iterations() == [2]  # uncommitted before save() returned
        assert old.exists()
        prepared.clear()
        third = threading.Thread(target=ckpt.save, args=(3,), kwargs={"model": {"w": torch.ones(4) * 3}})
        third.start()
        assert not prepared.wait(1.0)  # the third save waits for the deletion in flight
        release.set()
        third.join(30)
        assert not third.is_alive()
        ckpt.wait()
        assert ckpt.committed_iterations() == [3]
    assert order == ["prepare 1", "prepare 2", "deleted 1", "prepare 3", "deleted 2"], order
    assert not old.exists() and not (tmp_path / "iter_000000002").exists()


def test_a_save_whose_early_look_for_retention_fails_still_commits_and_retention_reads_again(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention's listing and records go out with the save's first requests; their failure is
    retention's (read again after the commit), never the save's."""
    training = _save_trained(memory_backend, [1, 2])
    real_list, real_record = listing.list_save_dirname, listing.listed_record
    failed: list[str] = []

    def list_once_failing(root: Any) -> Any:
        if not failed:
            failed.append("listing")
            raise ConnectionError("network down")
        return real_list(root)

    def record_once_failing(root: Any, listing: Any, iteration: int) -> Any:
        if "record" not in failed:
            failed.append("record")
            raise ConnectionError("network down")
        return real_record(root, listing, iteration)

    with _ckpt(memory_backend, keep_last_n=2) as ckpt:
        monkeypatch.setattr(listing, "list_save_dirname", list_once_failing)
        training.run(1)
        ckpt.save(3, **training.keys())  # the listing at its start fails
        assert failed == ["listing"]
        assert ckpt.committed_iterations() == [2, 3]
        monkeypatch.setattr(listing, "listed_record", record_once_failing)
        training.run(1)
        ckpt.save(4, **training.keys())  # the record read with its claim fails
        assert failed == ["listing", "record"]
        assert ckpt.committed_iterations() == [3, 4]


def test_retention_deletes_nothing_when_it_cannot_tell_what_is_committed(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    training = _save_trained(memory_backend, [1, 2])
    fs, _ = _fs_path(memory_backend, fresh=False)
    real_find, real_info = fs.find, fs.info
    hidden = "iter_000000002/model/"

    # fsspec's generic listing skips what it fails to read; the follow-up check then fails too.
    def lossy_find(path: str, *args: Any, **kwargs: Any) -> Any:
        found = real_find(path, *args, **kwargs)  # with detail=True a dict of path → info
        if isinstance(found, dict):
            return {p: info for p, info in found.items() if hidden not in p}
        return [p for p in found if hidden not in p]

    def failing_info(path: str, **kwargs: Any) -> Any:
        if hidden in path:
            raise ConnectionError("network down")
        return real_info(path, **kwargs)

    with _ckpt(memory_backend, keep_last_n=2) as ckpt:
        with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="dcp_fsspec"):
            patch.setattr(fs, "find", lossy_find)
            patch.setattr(fs, "info", failing_info)
            training.run(1)
            ckpt.save(3, **training.keys())
        assert "network down" in caplog.text
        assert ckpt.committed_iterations() == [1, 2, 3]  # nothing deleted on a guess


# -- arguments ----------------------------------------------------------------------------------


def test_unknown_async_mode_is_rejected_naming_the_choices(memory_backend: Backend) -> None:
    with pytest.raises(ValueError) as info:
        _ckpt(memory_backend, async_mode="async")
    assert "'async'" in str(info.value) and "'disabled'" in str(info.value)


@pytest.mark.parametrize("keep_last_n", [0, -1, 1.5, True])
def test_keep_last_n_must_be_a_positive_int(memory_backend: Backend, keep_last_n: Any) -> None:
    with pytest.raises(ValueError, match="keep_last_n"):
        _ckpt(memory_backend, keep_last_n=keep_last_n)


@pytest.mark.parametrize("iteration", [-1, 2.0, "3"])
def test_iteration_must_be_a_non_negative_int(memory_backend: Backend, iteration: Any) -> None:
    with _ckpt(memory_backend) as ckpt, pytest.raises(ValueError, match="iteration"):
        ckpt.save(iteration, trainer={"step": 1})


@pytest.mark.parametrize("key", [".hidden", "a/b", "", "-x"])
def test_key_that_cannot_be_a_folder_name_is_rejected(memory_backend: Backend, key: str) -> None:
    with _ckpt(memory_backend) as ckpt, pytest.raises(ValueError, match="folder name"):
        ckpt.save(1, **{key: {"step": 1}})


def test_optimizer_without_its_model_is_a_clear_error(memory_backend: Backend) -> None:
    training = Training()
    with _ckpt(memory_backend) as ckpt, pytest.raises(ValueError, match="model="):
        ckpt.save(1, optim=training.optim)
    with _ckpt(memory_backend) as ckpt:
        assert ckpt.committed_iterations() == []


def test_unsupported_value_is_a_type_error_naming_the_key(memory_backend: Backend) -> None:
    with _ckpt(memory_backend) as ckpt, pytest.raises(TypeError, match="'weights'"):
        ckpt.save(1, weights=torch.ones(2))


def test_finalized_checkpointer_refuses_to_save(memory_backend: Backend) -> None:
    with _ckpt(memory_backend) as ckpt:
        pass
    ckpt.finalize()  # twice is fine
    with pytest.raises(RuntimeError) as info:
        ckpt.save(1, trainer={"step": 1})
    assert memory_backend.url in str(info.value)


def test_iteration_names_round_trip_through_the_one_regex() -> None:
    assert layout.format_iteration(5) == "iter_000000005"
    assert layout.parse_iteration("s3://b/run/iter_000000005/") == 5
    assert layout.parse_iteration(layout.format_iteration(12_345_678_901)) == 12_345_678_901
    assert [layout.parse_iteration(n) for n in ("iter_5", "iter_00000000x", "xiter_000000005")] == [None] * 3


def test_rank_folder_names_round_trip_and_a_listed_name_is_bounded() -> None:
    assert [layout.parse_rank_folder(layout.rank_folder_name(r)) for r in (0, 7, 123_456_789)] == [
        0,
        7,
        123_456_789,
    ]
    # Names from a listing that are not ours: leading zeros, signs, other scripts' digits, and
    # a name whose digits int() would refuse (over 4300) or take long to read.
    bad = ("rank", "rank01", "rank-1", "rank+1", "rank\u0663", "xrank1", "rank1x", "rank" + "9" * 5000)
    assert [layout.parse_rank_folder(n) for n in bad] == [None] * len(bad)


def test_verify_before_commit_refuses_a_damaged_iteration_and_keeps_the_pointer(
    local_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(local_backend.url, verify_before_commit=True) as ckpt:
        ckpt.save(1, trainer={"w": torch.arange(4096.0)})
        flip_a_byte_of_each_data_file_once_written(monkeypatch)
        with pytest.raises(CorruptCheckpointError) as info:
            ckpt.save(2, trainer={"w": torch.arange(4096.0) * 2})
        assert "iter_000000002" in str(info.value) and "'trainer'" in str(info.value)
        assert ckpt.latest_checkpoint() == "iter_000000001"


def test_callbacks_and_one_log_line_report_bytes_and_time_of_each_save_and_load(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    from dcp_fsspec import CheckpointEvent

    events: list[CheckpointEvent] = []
    state = {"w": torch.randn(1000), "step": 3}
    with caplog.at_level(logging.INFO, logger="dcp_fsspec.checkpoint"):
        with Checkpointer(
            backend.url,
            backend.storage_options,
            on_event=events.append,
        ) as ckpt:
            ckpt.save(3, trainer=state)
            assert ckpt.load(trainer={"w": torch.zeros(1000), "step": 0}) == 3
    assert [e.kind for e in events] == ["save_start", "save_end", "load_end"]
    assert all(e.nbytes == 4000 and e.iteration == 3 and e.keys == ("trainer",) for e in events)
    assert events[1].seconds > 0 and events[1].gbps > 0 and events[1].url.endswith("iter_000000003")
    # The records written: the tensor's bytes and its header, and the pickled step.
    assert (
        events[1].written_bytes is not None
        and events[1].written_bytes > 4000
        and events[1].referenced_bytes == 0
    )
    assert events[0].written_bytes is None and events[2].written_bytes is None
    lines = [r.getMessage() for r in caplog.records if r.name == "dcp_fsspec.checkpoint"]
    # 4000 bytes in units that show them, never "0.0 MiB ... 0.000 GB/s".
    assert any(m.startswith("saved ") and "iter_000000003" in m and "(trainer; 3.9 KiB)" in m for m in lines)
    assert any(m.startswith("loaded ") and "3.9 KiB" in m and "/s" in m for m in lines)
    assert not any("0.0 MiB" in m or "0.000 GB/s" in m for m in lines)


def test_an_asynchronous_save_reports_its_end_once_it_is_committed(local_backend: Backend) -> None:
    ends: list[Any] = []
    with Checkpointer(
        local_backend.url,
        async_mode="async_with_pinned_mem",
        on_event=lambda e: ends.append(e) if e.kind == "save_end" else None,
    ) as ckpt:
        ckpt.save(1, trainer={"w": torch.randn(256)})
        ckpt.wait()
        assert [e.iteration for e in ends] == [1] and ends[0].nbytes == 1024
        ckpt.save(2, trainer={"w": torch.randn(256)})
    assert [e.iteration for e in ends] == [1, 2]  # finalize waited and reported the last one
