"""The commit protocol's pieces, each held to what it promises: the pointer (moves forward only,
tells why it did not move, refuses garbage), the iteration listing and retention's deletions.

The Checkpointer's tests reach these through whole saves, where the pointer's compare-and-swap
rarely loses and retention rarely fails; these tests drive each case directly, on the backends
of one process (local disk, memory://). They also run under ``make mutation``.
"""

from __future__ import annotations

import fractions
import json
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import (
    Checkpointer,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FsspecStorageWriter,
    StorageError,
)
from dcp_fsspec.checkpoint.commit import (
    commit_record as record,
)
from dcp_fsspec.checkpoint.commit import (
    committing,
    deletion,
    layout,
    loadable,
    pointer,
    retention,
    run_listing,
)
from dcp_fsspec.checkpoint.commit.commit_record import CommitRecord, read_commit_record
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, POINTER_NAME
from dcp_fsspec.storage.transport.urls import Location, resolve
from dcp_fsspec.storage.write.file_plan import WriteContext
from tests.conftest import Backend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest) -> Location:
    """An empty ``save_dirname`` on a backend of this process."""
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    return resolve(backend.url, backend.storage_options)


def _committed(root: Location, iteration: int) -> bool:
    """Whether ``iteration`` has a commit record and every key it lists has ``.metadata``."""
    return run_listing.inspect_iteration(root, iteration)[0] is not None


def _pointer_file(root: Location) -> bytes:
    return root.fs.cat_file(root.join(POINTER_NAME))


def _save(root: Location, *iterations: int) -> None:
    with Checkpointer(root.url) as ckpt:
        for iteration in iterations:
            ckpt.save(iteration, model={"w": torch.full((4,), float(iteration))})


def _put(root: Location, *names: str, data: bytes = b"x") -> None:
    path = root.join(*names)
    root.fs.makedirs(root.fs._parent(path), exist_ok=True)
    root.fs.pipe_file(path, data)


def _messages(caplog: pytest.LogCaptureFixture, module: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == module.__name__]


def _set_pointer(root: Location, iteration: int) -> None:
    """Put the pointer anywhere, as a run with another history would have left it."""
    committing.write_atomically(
        root, root.join(POINTER_NAME), f"{layout.format_iteration(iteration)}\n".encode()
    )


def test_the_pointer_moves_forward_stays_on_a_repeat_and_never_moves_back(
    root: Location, caplog: pytest.LogCaptureFixture
) -> None:
    """Guarantee row: 'the pointer names only committed iterations and never moves back' (local, memory)."""
    assert pointer.read_pointer(root) is None
    assert pointer.write_pointer(root, 3) is True
    assert pointer.write_pointer(root, 7) is True
    assert pointer.write_pointer(root, 7) is True  # a repeat (a retried save) is not a move back
    with caplog.at_level(logging.WARNING, logger="dcp_fsspec.checkpoint.commit.pointer"):
        assert pointer.write_pointer(root, 5) is False
    assert pointer.read_pointer(root) == 7
    assert _pointer_file(root) == b"iter_000000007\n"
    assert _messages(caplog, pointer) == [
        f"{pointer.pointer_url(root)} names iter_000000007, newer than iter_000000005; the pointer does not move backwards"
    ]


def test_a_pointer_holding_garbage_is_neither_read_nor_overwritten(root: Location) -> None:
    """A pointer someone else wrote is an error naming it, never silently replaced."""
    _put(root, POINTER_NAME, data=b"iter_000000002/model\n")
    for call in (lambda: pointer.read_pointer(root), lambda: pointer.write_pointer(root, 3)):
        with pytest.raises(CorruptCheckpointError, match="not an iteration folder name") as raised:
            call()
        assert pointer.pointer_url(root) in str(raised.value) and "'iter_000000002/model'" in str(
            raised.value
        )
    assert _pointer_file(root) == b"iter_000000002/model\n"


def test_a_pointer_other_writers_keep_changing_is_a_storage_error_naming_it_and_the_folder(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On S3 the compare-and-swap (a PUT conditional on the ETag read) loses when another run
    writes between the read and the PUT; after as many rounds as it allows, the pointer update
    stops with an error that says why, and the other run's pointer is left as it wrote it."""
    root = resolve(s3_backend.url, s3_backend.storage_options)
    assert pointer.write_pointer(root, 1)
    backend_type = type(root.backend)
    real_replace = backend_type.replace_if_unchanged
    rounds: list[str] = []

    def another_writer_first(self: Any, path: str, data: bytes, expected: Any) -> bool:
        rounds.append(path)
        self.fs.pipe_file(path, f"{layout.format_iteration(len(rounds) + 1)}\n".encode())  # still behind us
        return real_replace(self, path, data, expected)

    monkeypatch.setattr(backend_type, "replace_if_unchanged", another_writer_first)
    with pytest.raises(StorageError) as raised:
        pointer.write_pointer(root, 99)
    message = str(raised.value)
    assert f"cannot move {pointer.pointer_url(root)} to iter_000000099: it changed " in message
    assert f"times while we tried; is another run saving to {root.url}?" in message
    assert len(rounds) > 1 and set(rounds) == {root.join(POINTER_NAME)}
    assert pointer.read_pointer(root) == len(rounds) + 1


def test_iterations_are_the_iteration_folders_ascending_committed_or_not(root: Location) -> None:
    """list_iterations: folders named like iterations, whatever they hold; not files, not other names."""
    assert layout.list_iterations(root) == []  # nothing there yet
    _save(root, 3, 10)
    _put(root, "iter_000000001", "model", "leftover")  # an uncommitted folder
    _put(root, "iter_000000007", data=b"a file, not a folder")
    _put(root, "notes", "iter_000000004")
    assert layout.list_iterations(root) == [1, 3, 10]


def test_an_iteration_listing_that_fails_is_a_storage_error_naming_the_folder(
    root: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(root.fs), "ls", denied)
    with pytest.raises(StorageError) as raised:
        layout.list_iterations(root)
    assert str(raised.value).startswith(f"cannot list checkpoints under {root.url}: ")
    assert isinstance(raised.value.__cause__, PermissionError)


def test_retention_deletes_what_its_plan_says_and_reports_it(
    root: Location, caplog: pytest.LogCaptureFixture
) -> None:
    """keep_last_n=2 with the pointer on 4: 3 and 4 stay, 5 (newer, being written) stays, 1 and 2 go."""
    _save(root, 1, 2, 3, 4, 5)
    _set_pointer(root, 4)
    _put(root, "iter_000000000", "model", "debris")  # an uncommitted folder below
    with caplog.at_level(logging.INFO, logger="dcp_fsspec.checkpoint.commit.retention"):
        assert retention.apply_retention(root, 2, protected=(5,)) == [0, 1, 2]
    assert layout.list_iterations(root) == [3, 4, 5]
    assert pointer.read_pointer(root) == 4
    assert _messages(caplog, retention) == [
        f"deleted ['iter_000000000', 'iter_000000001', 'iter_000000002'] under {root.url} (keep_last_n=2)"
    ]
    # The pointer's own iteration and what the caller names as latest decide, not what is newest.
    assert retention.apply_retention(root, 1, latest=5) == [3, 4]
    assert layout.list_iterations(root) == [5]


def test_retention_keeps_n_committed_counting_only_committed_iterations(root: Location) -> None:
    """Uncommitted folders do not count towards keep_last_n: two committed ones stay."""
    _save(root, 1, 2, 4)
    root.fs.rm(root.join("iter_000000002", COMMIT_RECORD_NAME))  # 2 is no longer committed
    assert retention.apply_retention(root, 2) == [2]
    assert layout.list_iterations(root) == [1, 4]
    assert run_listing.committed_iterations(root) == [1, 4]


def test_retention_without_a_pointer_deletes_nothing(root: Location) -> None:
    _save(root, 1, 2, 3)
    root.fs.rm(root.join(POINTER_NAME))
    assert retention.apply_retention(root, 1) == []
    assert layout.list_iterations(root) == [1, 2, 3]


def test_a_failed_deletion_is_logged_skipped_and_the_rest_still_deleted(
    root: Location, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _save(root, 1, 2, 3)
    real_remove = deletion.remove_iterations

    def remove(where: Location, iterations: list[int]) -> None:
        if 1 in iterations:  # the bulk delete fails, then iteration 1 alone
            raise PermissionError(13, "Permission denied")
        real_remove(where, iterations)

    monkeypatch.setattr(deletion, "remove_iterations", remove)
    with caplog.at_level(logging.WARNING, logger="dcp_fsspec.checkpoint.commit.retention"):
        assert retention.apply_retention(root, 1) == [2]
    assert layout.list_iterations(root) == [1, 3]
    assert _messages(caplog, retention) == [
        f"could not delete iter_000000001 under {root.url} (retried at the next save): [Errno 13] Permission denied"
    ]


def test_retention_that_cannot_read_the_pointer_deletes_nothing_and_says_so(
    root: Location, caplog: pytest.LogCaptureFixture
) -> None:
    _save(root, 1, 2, 3)
    root.fs.pipe_file(root.join(POINTER_NAME), b"garbage")
    with caplog.at_level(logging.WARNING, logger="dcp_fsspec.checkpoint.commit.retention"):
        assert retention.apply_retention(root, 1) == []
    assert layout.list_iterations(root) == [1, 2, 3]
    (message,) = _messages(caplog, retention)
    assert message.startswith(f"retention skipped under {root.url} (retried at the next save): ")
    assert pointer.pointer_url(root) in message


def test_publishing_an_iteration_the_pointer_passed_is_refused_with_what_to_do(root: Location) -> None:
    """Another run moved the pointer past this iteration while it was written: not committed."""
    _save(root, 7)
    with pytest.raises(CheckpointExistsError) as raised:
        committing.publish(root, 5, ("model",), 1)
    assert str(raised.value) == (
        f"cannot commit {root.url_of(layout.iteration_path(root, 5))}: {pointer.pointer_url(root)} moved to the "
        f"newer iter_000000007 while it was being saved, so another run is saving to {root.url}; the pointer "
        "never moves backwards, so this iteration stays uncommitted. Give each run its own save_dirname"
    )
    assert pointer.read_pointer(root) == 7 and not _committed(root, 5)


def test_a_publish_whose_pointer_update_loses_the_race_reports_the_newer_iteration(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between this save's read of the pointer and its conditional PUT another run moved it to a
    newer iteration: the save is committed, the pointer stays on the other run's iteration, and
    publish says which."""
    root = resolve(s3_backend.url, s3_backend.storage_options)
    assert pointer.write_pointer(root, 3)
    writer = FsspecStorageWriter(root.url_of(layout.key_path(root, 5, "model")), s3_backend.storage_options)
    dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)
    backend_type = type(root.backend)
    real_replace = backend_type.replace_if_unchanged
    moved: list[str] = []

    def another_run_first(self: Any, path: str, data: bytes, expected: Any) -> bool:
        if path.endswith(POINTER_NAME) and not moved:
            moved.append(path)
            self.fs.pipe_file(path, b"iter_000000009\n")
        return real_replace(self, path, data, expected)

    monkeypatch.setattr(backend_type, "replace_if_unchanged", another_run_first)
    assert committing.publish(root, 5, ("model",), 1) == 9
    assert moved and pointer.read_pointer(root) == 9 and _committed(root, 5)


@pytest.mark.parametrize("keep_last_n", [0, -1])
def test_a_retention_plan_for_fewer_than_one_iteration_is_refused_naming_the_value(keep_last_n: int) -> None:
    with pytest.raises(ValueError) as raised:
        retention.plan_deletions([1, 2], [1, 2], keep_last_n=keep_last_n, latest=2)
    assert str(raised.value) == f"keep_last_n must be >= 1, got {keep_last_n}"


def _written_key(root: Location, iteration: int, save_id: str) -> None:
    """One key of ``iteration`` finished by a save whose token is ``save_id``; not committed."""
    writer = FsspecStorageWriter(
        root.url_of(layout.key_path(root, iteration, "model")), _context=WriteContext(save_id=save_id)
    )
    dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)


def test_publish_commits_only_a_key_its_own_save_wrote(root: Location) -> None:
    """A key whose .metadata carries another save's token is not committed by this one."""
    _written_key(root, 5, save_id="a" * 32)
    with pytest.raises(CheckpointExistsError) as raised:
        committing.publish(root, 5, ("model",), 1, save_id="b" * 32)
    assert root.url_of(layout.iteration_path(root, 5)) in str(raised.value)
    assert not _committed(root, 5) and pointer.read_pointer(root) is None
    assert committing.publish(root, 5, ("model",), 1, save_id="a" * 32) == 5
    assert _committed(root, 5)


def test_publish_over_a_garbage_pointer_is_an_error_naming_it(root: Location) -> None:
    _written_key(root, 5, save_id="a" * 32)
    _put(root, POINTER_NAME, data=b"not a folder name\n")
    with pytest.raises(CorruptCheckpointError) as raised:
        committing.publish(root, 5, ("model",), 1, save_id="a" * 32)
    assert pointer.pointer_url(root) in str(raised.value)
    assert not _committed(root, 5)


def test_retention_spares_an_older_iteration_being_rewritten(root: Location) -> None:
    """An overwrite of iteration 1 behind the pointer (4) is protected while it is written."""
    _save(root, 1, 2, 3, 4)
    assert retention.apply_retention(root, 1, protected=(1,)) == [2, 3]
    assert layout.list_iterations(root) == [1, 4]


def test_why_an_iteration_is_not_committed_says_what_left_it_and_names_the_missing_file(
    root: Location,
) -> None:
    """inspect_iteration and listed_inspection give ls, cp and load's errors their reason: a folder
    without a record below the pointer may be retention's interrupted deletion; at or above it,
    only an unfinished save; a record whose key lacks .metadata names that file."""
    _save(root, 3, 5, 6)
    _put(root, "iter_000000004", "model", "debris")
    root.fs.rm(root.join("iter_000000005", COMMIT_RECORD_NAME))
    metadata_of_6 = root.join("iter_000000006", "model", ".metadata")
    root.fs.rm(metadata_of_6)
    never_finished = "has no .commit.json (its save never finished)"
    interrupted = (
        "has no .commit.json: a save that failed, or a deletion by retention that was interrupted, "
        "left it; retention deletes it at the next save"
    )
    listed = run_listing.list_save_dirname(root)
    for inspect in (
        lambda i, latest: run_listing.inspect_iteration(root, i, latest=latest),
        lambda i, latest: run_listing.listed_inspection(root, listed, i, latest=latest),
    ):
        assert inspect(4, None) == (None, never_finished)
        assert inspect(4, 5) == (None, interrupted)
        assert inspect(5, 5) == (None, never_finished)  # the pointer's own iteration was never committed
        assert inspect(6, 5) == (None, f"lacks {root.url_of(metadata_of_6)}")
        record, why = inspect(3, 5)
        assert why is None and record is not None and (record.iteration, record.keys) == (3, ("model",))
    assert run_listing.inspect_iteration(root, 9) == (None, "does not exist")


def test_a_committed_folder_another_save_wrote_into_is_refused_naming_it_and_the_stray_key(
    root: Location,
) -> None:
    """require_saved_together, load's token check: a key whose .metadata another save wrote after
    the commit is never loaded as part of it; a record from before tokens (no save_id) is not checked."""
    _written_key(root, 5, save_id="a" * 32)
    record = committing.commit_record(root, 5, ("model",), 1, save_id="a" * 32)
    loadable.require_saved_together(root, record)  # whole: nothing to say
    _written_key(root, 5, save_id="b" * 32)  # a zombie of the same run rewrote the key
    with pytest.raises(CorruptCheckpointError) as raised:
        loadable.require_saved_together(root, record)
    metadata = root.url_of(root.join("iter_000000005", "model", ".metadata"))
    assert str(raised.value) == (
        f"{root.url_of(root.join('iter_000000005'))} is not the checkpoint its .commit.json committed: "
        f"{metadata} was written by another save (save_id {'b' * 32!r}, not {'a' * 32!r}) (another process "
        "saved the same iteration into it); it is not loaded. Load another iteration, or delete this folder"
    )
    loadable.require_saved_together(root, CommitRecord(5, ("model",), 1, 0.0, save_id=None))


def test_the_token_check_lists_the_iteration_once_instead_of_checking_each_data_file(
    root: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load's token check costs one listing and one read per key, not one request per data file."""
    _written_key(root, 5, save_id="a" * 32)
    record = committing.commit_record(root, 5, ("model",), 1, save_id="a" * 32)
    backend_type = type(root.backend)
    calls: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        # The backend's listing, its reads of small files, and every other call that reaches
        # the store (local disk answers the first two with os calls of its own, not call()).
        real = getattr(backend_type, name)

        def count(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(f"call:{args[0]}" if name == "call" else name)
            return real(self, *args, **kwargs)

        return count

    for name in ("find", "read_versioned", "call"):
        monkeypatch.setattr(backend_type, name, counted(name))
    loadable.require_saved_together(root, record)
    # One listing and one read of the key's .metadata (each, on a generic backend, the one
    # call to the store it makes), nothing per data file.
    assert sorted(c for c in calls if c not in ("call:find", "call:cat_file")) == ["find", "read_versioned"]
    assert len(calls) <= 4
    calls.clear()
    committing.commit_record(root, 6, (), 1, save_id="a" * 32)  # nothing to check: no key
    _written_key(root, 7, save_id="a" * 32)
    calls.clear()
    committing.commit_record(root, 7, ("model",), 1, save_id="a" * 32)  # the same at commit time
    assert "call:info" not in calls and calls.count("find") == 1


def test_a_commit_unpickles_nothing_outside_the_allow_list_from_a_keys_metadata(root: Location) -> None:
    """The commit reads each key's .metadata for its token; a .metadata holding any other object
    (here a Fraction, harmless but not DCP's) is refused, never unpickled in full."""
    _written_key(root, 5, save_id="a" * 32)
    path = root.join("iter_000000005", "model", ".metadata")
    metadata = pickle.loads(root.fs.cat_file(path))  # our own file: trusted here
    metadata.planner_data = {"x": fractions.Fraction(1, 3)}
    root.fs.pipe_file(path, pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError) as raised:
        committing.publish(root, 5, ("model",), 1, save_id="a" * 32)
    assert root.url_of(path) in str(raised.value)
    assert not _committed(root, 5) and pointer.read_pointer(root) is None
    # A load the user told to trust the checkpoint (trust_checkpoint=True) checks it in full.
    record = CommitRecord(5, ("model",), 1, 0.0, save_id="a" * 32)
    with pytest.raises(CorruptCheckpointError):
        loadable.require_saved_together(root, record)
    loadable.require_saved_together(root, record, trust_checkpoint=True)


def test_a_pointer_deleted_while_a_publish_lost_its_race_is_a_storage_error_naming_it(
    root: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The narrowest race: the compare-and-swap lost, and the pointer is gone when publish re-reads it."""
    _written_key(root, 5, save_id="a" * 32)

    def a_third_writer_deleted_it(where: Location, iteration: int) -> bool:
        root.fs.rm(root.join(POINTER_NAME))
        return False

    pointer.write_pointer(root, 2)
    monkeypatch.setattr(pointer, "replace_pointer", lambda *args: False)
    monkeypatch.setattr(pointer, "write_pointer", a_third_writer_deleted_it)
    with pytest.raises(StorageError) as raised:
        committing.publish(root, 5, ("model",), 1, save_id="a" * 32)
    assert (
        str(raised.value) == f"{pointer.pointer_url(root)} disappeared while this save moved it; save again"
    )


def test_a_pointer_naming_an_uncommitted_folder_is_an_error_listing_the_committed_ones(
    root: Location,
) -> None:
    """require_committed, what load says when the pointer names a folder that is not committed:
    why, which iterations are (or that none is), and what to do."""
    _save(root, 3, 5)
    for iteration in (5, 3):
        root.fs.rm(root.join(layout.format_iteration(iteration), COMMIT_RECORD_NAME))
        with pytest.raises(CheckpointNotFoundError) as raised:
            loadable.require_committed(root, 5)  # named by the pointer
        committed = "['iter_000000003']" if iteration == 5 else "none"
        assert str(raised.value) == (
            f"{pointer.pointer_url(root)} names {root.url_of(root.join('iter_000000005'))}, which has no .commit.json (its save "
            f"never finished); committed iterations there: {committed}. Restore that folder, or rewrite "
            "latest_checkpoint.txt to name a committed iteration (or delete it to start over)"
        )


def test_one_listing_finds_an_empty_iteration_folder_and_not_a_file_of_that_name(root: Location) -> None:
    """list_save_dirname: a name with nothing listed under it is a folder only if it is one (the
    request that tells them apart is made only for such names). listed_inspection trusts an
    absence only inside a folder the listing read: elsewhere it reads the record."""
    before = run_listing.list_save_dirname(root)
    _save(root, 3)
    root.fs.makedirs(root.join("iter_000000004"), exist_ok=True)
    _put(root, "iter_000000007", data=b"a file, not a folder")
    _put(root, "iter_000000005X", "model", "debris")  # not an iteration's name
    _put(root, "iter_000000008", ".commit.jsonX")  # nor is this a commit record
    _put(root, "iter_000000008", "empty", data=b"")
    _put(root, "iter_000000009", ".commit.json ")  # nor this
    _put(root, "iter_000000009", "model", ".metadata\t")  # nor this a finished key
    listed = run_listing.list_save_dirname(root)
    assert listed.folders == (3, 4, 8, 9)
    assert (listed.read, listed.records, listed.finished) == ({3, 8, 9}, {3}, {(3, "model")})
    # What ls shows as an iteration's size: its files' bytes, not its folders' nor a bare file's.
    sizes = {i: listed.size(i) for i in listed.files}
    assert sizes == {
        3: sum(root.fs.info(f)["size"] for f in root.fs.find(root.join("iter_000000003"))),
        8: 1,
        9: 2,
    }
    assert run_listing.committed_iterations(root) == [3]
    assert run_listing.listed_inspection(root, listed, 4) == (
        None,
        "has no .commit.json (its save never finished)",
    )
    assert (
        run_listing.listed_inspection(root, listed, 4, latest=5)[1]
        == run_listing.inspect_iteration(root, 4, latest=5)[1]
    )
    record, _ = run_listing.listed_inspection(root, before, 3)  # a listing older than the save
    assert record is not None and record.iteration == 3


@pytest.mark.parametrize("name", ["run 1 ", "runX"])
def test_a_save_dirname_whose_name_ends_in_a_space_or_any_letter_still_lists_its_iterations(
    tmp_path: Any, name: str
) -> None:
    root = resolve(str(tmp_path / name))
    _save(root, 1, 2)
    assert run_listing.committed_iterations(root) == [1, 2] and run_listing.list_save_dirname(
        root
    ).folders == (1, 2)


def test_a_key_whose_data_file_is_missing_is_not_committed_naming_the_file(root: Location) -> None:
    """The commit checks that every data file a key's .metadata names is there, and names the one that is not."""
    _written_key(root, 5, save_id="a" * 32)
    (data, *_) = [
        f for f in root.fs.find(root.join("iter_000000005", "model")) if not f.endswith(".metadata")
    ]
    root.fs.rm(data)
    with pytest.raises(CheckpointExistsError) as raised:
        committing.publish(root, 5, ("model",), 1, save_id="a" * 32)
    metadata = root.url_of(root.join("iter_000000005", "model", ".metadata"))
    assert f"{root.url_of(data)}, which {metadata} names, is missing" in str(raised.value)
    assert not _committed(root, 5)


def _record_path(root: Location, iteration: int) -> str:
    return root.join(layout.format_iteration(iteration), ".commit.json")


def test_the_commit_record_is_indented_json_with_its_format_and_the_saves_token(root: Location) -> None:
    """The record is a small file other tools and later versions read: its fields are fixed."""
    _written_key(root, 5, save_id="a" * 32)
    committing.publish(root, 5, ("model",), 1, save_id="a" * 32)
    raw = root.fs.cat_file(_record_path(root, 5))
    doc = json.loads(raw)
    expected = {
        "format": 1,
        "iteration": 5,
        "keys": ["model"],
        "world_size": 1,
        "saved_at": doc["saved_at"],
        "save_id": "a" * 32,
    }
    assert raw == json.dumps(expected, indent=1).encode()
    assert abs(doc["saved_at"] - time.time()) < 3600
    # A record of a save without a token (written before tokens existed) has no save_id field.
    legacy = CommitRecord(5, ("model",), 1, 1.5)
    assert json.loads(legacy.to_json()) == {
        "format": 1,
        "iteration": 5,
        "keys": ["model"],
        "world_size": 1,
        "saved_at": 1.5,
    }


@pytest.mark.parametrize("fmt", [2, None, "1"])
def test_a_commit_record_of_another_format_is_refused_naming_it_and_what_to_do(
    root: Location, fmt: object
) -> None:
    """A record a newer version (or another program) wrote is not guessed at."""
    _save(root, 5)
    path = _record_path(root, 5)
    doc = json.loads(root.fs.cat_file(path))
    if fmt is None:
        del doc["format"]
    else:
        doc["format"] = fmt
    root.fs.pipe_file(path, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError) as raised:
        read_commit_record(root, 5)
    assert str(raised.value) == (
        f"commit record {root.url_of(path)} is unreadable (its format is {fmt!r}, this dcp_fsspec reads format 1: "
        "written by another version or another program; upgrade dcp_fsspec to read it); delete the folder "
        f"{root.url_of(layout.iteration_path(root, 5))} if that iteration is not needed"
    )


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"[1]", "(not an object)"),
        (b'{"format": 1, "keys": 5}', "(not an object with a list of keys)"),
        (
            b'{"format": 1, "iteration": 5, "keys": [], "world_size": 1, "saved_at": 1, "save_id": 7}',
            "(its save_id is not a string)",
        ),
        (b" " * (1024 * 1024 + 1), f"({1024 * 1024 + 1} bytes, more than a commit record's {1024 * 1024})"),
    ],
)
def test_a_malformed_commit_record_is_refused_saying_what_is_wrong_and_what_to_do(
    root: Location, raw: bytes, says: str
) -> None:
    _put(root, "iter_000000005", ".commit.json", data=raw)
    with pytest.raises(CorruptCheckpointError) as raised:
        read_commit_record(root, 5)
    folder = root.url_of(layout.iteration_path(root, 5))
    assert str(raised.value) == (
        f"commit record {root.url_of(_record_path(root, 5))} is unreadable {says}; delete the folder "
        f"{folder} if that iteration is not needed"
    )


def test_a_commit_record_of_exactly_the_size_limit_is_read(root: Location) -> None:
    record = CommitRecord(5, ("model",), 1, 1.5, "a" * 32)
    raw = record.to_json()
    _put(root, "iter_000000005", ".commit.json", data=raw + b" " * (1024 * 1024 - len(raw)))
    assert read_commit_record(root, 5) == record


def test_a_record_naming_another_token_than_its_keys_carry_is_not_loaded(root: Location) -> None:
    """The record's save_id is read and compared: a record whose keys another save wrote is refused."""
    _save(root, 5)
    path = _record_path(root, 5)
    doc = json.loads(root.fs.cat_file(path))
    theirs = doc["save_id"]
    doc["save_id"] = "f" * 32
    root.fs.pipe_file(path, json.dumps(doc).encode())
    record = read_commit_record(root, 5)
    assert record is not None and record.save_id == "f" * 32
    with pytest.raises(CorruptCheckpointError) as raised:
        loadable.require_saved_together(root, record)
    metadata = root.url_of(root.join("iter_000000005", "model", ".metadata"))
    assert f"{metadata} was written by another save (save_id {theirs!r}, not {'f' * 32!r})" in str(
        raised.value
    )


def test_a_key_whose_metadata_carries_no_token_is_not_committed_by_a_save_with_one(root: Location) -> None:
    """A key DCP wrote without our storage metadata (another writer) is no save's of ours."""
    _written_key(root, 5, save_id="a" * 32)
    path = root.join("iter_000000005", "model", ".metadata")
    metadata = pickle.loads(root.fs.cat_file(path))
    metadata.storage_meta = None
    root.fs.pipe_file(path, pickle.dumps(metadata))
    with pytest.raises(CheckpointExistsError) as raised:
        committing.publish(root, 5, ("model",), 1, save_id="a" * 32)
    assert f"{root.url_of(path)} was written by another save (save_id None, not {'a' * 32!r})" in str(
        raised.value
    )
    assert not _committed(root, 5)


def test_taking_over_a_folder_whose_record_lists_an_unfinished_key_clears_everything_but_the_mark(
    root: Location,
) -> None:
    """A record whose keys are not all finished commits nothing: it is a leftover like any other
    file, taken over and deleted, whatever the names (even ones that extend the record's)."""
    _save(root, 5)
    root.fs.rm(root.join("iter_000000005", "model", ".metadata"))
    for name in (".commit.json ", ".commit.jsonX", committing.CLAIM_NAME, committing.LEGACY_CLAIM_NAME):
        _put(root, "iter_000000005", name)
    committing.take_over_iteration(root, 5, "b" * 32, replacing=None)
    left = [f for f in root.fs.find(layout.iteration_path(root, 5))]
    assert [f.rsplit("/", 1)[-1] for f in left] == [".commit.json"]
    assert json.loads(root.fs.cat_file(left[0])) == {"format": 1, "taken_over_by": "b" * 32}
    assert read_commit_record(root, 5) is None


def test_a_committed_iteration_holds_its_claim_under_a_name_that_says_what_it_is_not_saving(
    root: Location,
) -> None:
    """The claim stays after the commit: named ``.saving`` it read as a save left unfinished."""
    _save(root, 5)
    folder = layout.iteration_path(root, 5)
    names = sorted(p.rsplit("/", 1)[-1] for p in root.fs.ls(folder, detail=False))
    assert names == [".claimed_by", ".commit.json", "model"]
    claimed_by = root.fs.cat_file(root.join("iter_000000005", ".claimed_by")).decode()
    assert claimed_by == read_commit_record(root, 5).save_id


def test_an_iteration_of_an_earlier_version_with_a_saving_claim_loads_and_is_pruned_whole(
    root: Location,
) -> None:
    _save(root, 5)
    path = root.join("iter_000000005", committing.CLAIM_NAME)
    _put(root, "iter_000000005", ".saving", data=root.fs.cat_file(path))
    root.fs.rm(path)
    target = {"w": torch.zeros(4)}
    with Checkpointer(root.url, keep_last_n=1) as ckpt:
        assert ckpt.load(model=target) == 5 and torch.equal(target["w"], torch.full((4,), 5.0))
        ckpt.save(6, model={"w": torch.full((4,), 6.0)})
        ckpt.wait()
    assert run_listing.committed_iterations(root) == [6] and not root.fs.exists(
        layout.iteration_path(root, 5)
    )


def test_create_atomically_writes_once_and_says_whether_the_name_holds_this_callers_data(
    root: Location,
) -> None:
    """The claim's primitive: the first write wins; a repeat of the same bytes (a retry whose
    first answer was lost) counts as this caller's; other bytes lose and change nothing."""
    path = root.join("iter_000000005", committing.CLAIM_NAME)
    root.fs.makedirs(layout.iteration_path(root, 5), exist_ok=True)
    assert committing.create_atomically(root, path, b"first")
    assert not committing.create_atomically(root, path, b"second")
    assert committing.create_atomically(root, path, b"first")
    assert root.fs.cat_file(path) == b"first"


def test_where_no_lock_spans_processes_no_save_takes_the_claim_and_nothing_is_requested() -> None:
    """GCS (like Azure and SFTP) has no way to make one writer of several processes the creator:
    every save names its data files by its token instead, so the claim is never taken."""
    root = resolve("gs://bucket/run", {"token": "anon", "endpoint_url": "http://127.0.0.1:9"})
    assert not root.backend.exclusive_across_processes
    assert committing.claim_iteration(root, 5, "a" * 32) is False


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (b"../iter_000000005\n", "../iter_000000005"),  # a path, even one ending in a name
        (b"iter_" + b"7" * 100, "iter_" + "7" * 55),  # shown up to 60 characters
        (b"\xff" + b"a" * 49, repr(b"\xff" + b"a" * 39)),  # not text: its first 40 bytes
    ],
)
def test_a_pointer_that_is_not_an_iteration_name_is_refused_showing_what_it_holds(
    root: Location, raw: bytes, shown: str
) -> None:
    _put(root, POINTER_NAME, data=raw)
    with pytest.raises(CorruptCheckpointError) as raised:
        pointer.read_pointer(root)
    assert str(raised.value) == (
        f"{pointer.pointer_url(root)} holds {shown!r}, not an iteration folder name like 'iter_000000005'; "
        "write the name of a committed iteration into it, or delete it to start over"
    )


def test_iteration_names_hold_up_to_18_digits_and_no_more() -> None:
    assert layout.format_iteration(10**18 - 1) == "iter_" + "9" * 18
    assert layout.parse_iteration("iter_" + "9" * 18) == 10**18 - 1
    for bad in (10**18, -1, True, 1.0):
        with pytest.raises(ValueError) as raised:
            layout.format_iteration(bad)  # type: ignore[arg-type]
        assert str(raised.value) == f"iteration must be an int >= 0 of at most 18 digits, got {bad!r}"


@pytest.mark.parametrize("key", [".metadata", "-x", "a/b", "", "model "])
def test_a_key_that_cannot_be_a_folder_name_is_refused_saying_which_names_can(key: str) -> None:
    with pytest.raises(ValueError) as raised:
        layout.check_key(key)
    assert str(raised.value) == (
        f"checkpoint key {key!r} cannot be a folder name; use letters, digits, '_', '-', '.' "
        "and do not start with '.' or '-'"
    )


def test_a_commit_whose_key_never_finished_is_refused_naming_the_key_and_what_to_do(root: Location) -> None:
    _written_key(root, 5, save_id="a" * 32)
    with pytest.raises(CheckpointNotFoundError) as raised:
        committing.commit_record(root, 5, ("model", "optim"), 1, save_id="a" * 32)
    folder, key = root.url_of(layout.iteration_path(root, 5)), root.url_of(layout.key_path(root, 5, "optim"))
    assert str(raised.value) == (
        f"cannot commit {folder}: key 'optim' at {key} has no .metadata, so its save did not finish; save the iteration again"
    )
    assert read_commit_record(root, 5) is None


def test_a_commit_of_keys_another_save_wrote_or_after_another_commit_says_what_happened(
    root: Location,
) -> None:
    _written_key(root, 5, save_id="a" * 32)
    folder = root.url_of(layout.iteration_path(root, 5))
    metadata = root.url_of(root.join("iter_000000005", "model", ".metadata"))
    with pytest.raises(CheckpointExistsError) as raised:
        committing.commit_record(root, 5, ("model",), 1, save_id="b" * 32)
    assert str(raised.value) == (
        f"cannot commit {folder}: {metadata} was written by another save (save_id {'a' * 32!r}, not {'b' * 32!r}), "
        f"so another process is saving the same iteration into {root.url} (a restarted job racing the old one, or "
        "two jobs with one save_dirname); this save is not committed. Give each run its own save_dirname"
    )
    first = committing.commit_record(root, 5, ("model",), 1, save_id="a" * 32)
    with pytest.raises(CheckpointExistsError) as raised:
        committing.commit_record(root, 5, ("model",), 1, save_id="a" * 32)
    assert str(raised.value) == (
        f"cannot commit {folder}: another process committed it, or took it over, while this save wrote it (two "
        f"processes saving the same iteration into {root.url}); this save is not committed. Give each run its own save_dirname"
    )
    assert read_commit_record(root, 5) == first


def test_taking_over_a_folder_whose_record_is_unreadable_names_it_and_deletes_nothing(root: Location) -> None:
    _save(root, 5)
    path = _record_path(root, 5)
    root.fs.pipe_file(path, b"{not json")
    before = sorted(root.fs.find(layout.iteration_path(root, 5)))
    with pytest.raises(CorruptCheckpointError) as raised:
        committing.take_over_iteration(root, 5, "b" * 32, replacing=None)
    assert str(raised.value).startswith(f"commit record {root.url_of(path)} is unreadable (")
    assert sorted(root.fs.find(layout.iteration_path(root, 5))) == before


def test_saving_the_pointers_own_iteration_again_leaves_the_pointer_file_untouched(tmp_path: Any) -> None:
    """A repeat of the newest iteration (overwrite=True) commits it; the pointer already names
    it, so it is not written again (one request fewer on S3; here: the same file, not a new one)."""
    root = resolve(str(tmp_path / "run"))
    _save(root, 3)
    before = (tmp_path / "run" / POINTER_NAME).stat()
    with Checkpointer(root.url, overwrite=True) as ckpt:
        ckpt.save(3, model={"w": torch.zeros(4)})
    after = (tmp_path / "run" / POINTER_NAME).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert pointer.read_pointer(root) == 3 and _committed(root, 3)


def test_discard_iterations_deletes_the_folders_named_and_leaves_the_others_committed(root: Location) -> None:
    _save(root, 1, 2, 3)
    deletion.discard_iterations(root, [1, 2])
    assert layout.list_iterations(root) == [3]
    assert run_listing.committed_iterations(root) == [3] and _committed(root, 3)


@pytest.mark.parametrize(("recorded", "committed_then"), [(None, [3]), ([2], [1, 3])])
def test_discard_iterations_uncommits_the_recorded_before_removing_any_folder(
    root: Location, monkeypatch: pytest.MonkeyPatch, recorded: list[int] | None, committed_then: list[int]
) -> None:
    """Were the removal to die, no folder named would still be committed; ``recorded`` names the
    only ones whose records are deleted (the caller saw none in the others)."""
    _save(root, 1, 2, 3)
    seen: list[list[int]] = []

    def remove(where: Location, iterations: list[int]) -> None:
        seen.append(run_listing.committed_iterations(where))
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(deletion, "remove_iterations", remove)
    with pytest.raises(PermissionError):
        deletion.discard_iterations(root, [1, 2], recorded=recorded)
    assert seen == [committed_then]


def test_a_retired_mark_uncommits_the_iteration_and_keeps_its_files_referable(root: Location) -> None:
    _save(root, 1, 2, 3)
    saved = read_commit_record(root, 1)
    assert saved is not None
    mark = record.retired_mark(saved)
    assert json.loads(mark) == {**json.loads(saved.to_json()), "retired": True}
    root.fs.pipe_file(record.record_path(root, 1), mark)
    assert read_commit_record(root, 1) is None and run_listing.committed_iterations(root) == [2, 3]
    root.fs.rm(record.record_path(root, 2))
    assert [record.referable(root, i) for i in (1, 2, 3, 4)] == [True, False, True, False]


def test_a_record_retired_false_is_still_a_commit_record(root: Location) -> None:
    _save(root, 1)
    saved = read_commit_record(root, 1)
    assert saved is not None
    root.fs.pipe_file(
        record.record_path(root, 1), json.dumps({**json.loads(saved.to_json()), "retired": False}).encode()
    )
    assert read_commit_record(root, 1) == saved and record.referable(root, 1)


def test_whether_an_unreadable_record_is_referable_is_an_error_naming_it(root: Location) -> None:
    _save(root, 1)
    path = record.record_path(root, 1)
    root.fs.pipe_file(path, b"not json")
    with pytest.raises(CorruptCheckpointError, match="is unreadable") as raised:
        record.referable(root, 1)
    assert root.url_of(path) in str(raised.value)
