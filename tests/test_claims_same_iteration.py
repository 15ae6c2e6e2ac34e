"""Two saves of the *same* iteration into one folder, on the backends the security suite does not race.

``tests/security/test_concurrent_writers.py`` races two processes on local disk and S3, where
the commit record is created only if absent. GCS, Azure Blob and SFTP have no such create here
(it is locked within one process only), so the table promises the load-time check alone: two
saves may both report success, but a folder they both wrote into is never loaded
(``CorruptCheckpointError`` naming the URL); what loads is one writer's checkpoint, bit-exact.
``memory://`` lives in one process, so its two writers are two threads: there the table
promises what local disk does (at most one commits, the other gets an error naming the URL).
"""

from __future__ import annotations

import posixpath
import queue
import threading
from typing import Any

import pytest

from dcp_fsspec import Checkpointer, CorruptCheckpointError
from dcp_fsspec.checkpoint.commit import pointer
from dcp_fsspec.storage.transport.urls import resolve
from tests.conftest import Backend
from tests.security.test_concurrent_writers import ITERATION, ROUNDS, _empty_like, _equal, _race, _state

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(600),
]

LOSING = ("CheckpointExistsError", "CheckpointNotFoundError", "StorageError")


def _outcomes(results: Any) -> dict[int, dict[int, tuple[str, str]]]:
    outcomes: dict[int, dict[int, tuple[str, str]]] = {}
    for _ in range(2 * ROUNDS):
        round_, writer, how, message = results.get(timeout=240)
        outcomes.setdefault(round_, {})[writer] = (how, message)
    return outcomes


def _summary(state: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        k: {n: (v.flatten()[:2].tolist() if hasattr(v, "flatten") else v) for n, v in d.items()}
        for k, d in state.items()
    }


def _check_rounds(
    backend: Backend, outcomes: dict[int, dict[int, tuple[str, str]]], *, both_may_commit: bool
) -> dict[str, int]:
    """Each round's folder loads one writer's checkpoint, bit-exact, or nothing: never a mix.

    Returns how many rounds ended each way: "one" (a writer's checkpoint loaded), "refused"
    (the load raised ``CorruptCheckpointError`` naming the folder), "none" (nothing committed).
    """
    ends = {"one": 0, "refused": 0, "none": 0}
    for round_ in range(ROUNDS):
        url = f"{backend.url}/round_{round_:02d}"
        saved = [w for w, (how, _) in outcomes[round_].items() if how == "saved"]
        if not both_may_commit:
            assert len(saved) <= 1, (round_, outcomes[round_])
        for writer, (how, message) in outcomes[round_].items():
            if how != "saved":  # the loser: an error of our tree that names the folder
                assert how in LOSING, (round_, writer, how, message)
                assert url in message, (round_, writer, message)
        with Checkpointer(url, backend.storage_options) as ckpt:
            if not ckpt.committed_iterations():
                # Both failed: a save that began while the other was half-way cleared its
                # folder as leftovers (it cannot tell a running save from a dead one).
                assert not saved, (round_, outcomes[round_])
                ends["none"] += 1
                continue
            assert saved, (round_, outcomes[round_])
            target = _empty_like(_state(0, round_))
            try:
                assert ckpt.load(**target) == ITERATION
            except CorruptCheckpointError as e:
                assert both_may_commit and len(saved) == 2, (round_, outcomes[round_], e)
                assert url in str(e), e
                ends["refused"] += 1
                continue
        assert any(_equal(target, _state(w, round_)) for w in saved), (
            f"round {round_} loaded a mix, or a loser's values: {_summary(target)} {outcomes[round_]}"
        )
        ends["one"] += 1
    return ends


def test_two_threads_saving_the_same_memory_iteration_commit_one_writers_checkpoint_never_a_mix(
    memory_backend: Backend,
) -> None:
    """memory:// is one process's store, so its two writers are threads of one process.

    Guarantee row: 'two processes saving the *same* iteration into one folder never commit a mix' (memory)
    """
    start, results = threading.Barrier(2), queue.Queue()  # type: ignore[var-annotated]
    writers = [
        threading.Thread(target=_race, args=(memory_backend.url, {}, w, start, results)) for w in (0, 1)
    ]
    for thread in writers:
        thread.start()
    outcomes = _outcomes(results)
    for thread in writers:
        thread.join(timeout=60)
    ends = _check_rounds(memory_backend, outcomes, both_may_commit=False)
    assert ends["refused"] == 0 and ends["one"] >= 1, (ends, outcomes)
    # A race happened: some round had a loser.
    assert any(how != "saved" for round_ in outcomes.values() for how, _ in round_.values()), outcomes


@pytest.mark.parametrize("backend_name", ["memory", "gcs", "azure", "sftp"])
def test_a_folder_whose_key_another_save_replaced_is_never_loaded(
    backend_name: str, request: pytest.FixtureRequest
) -> None:
    """The load-time check itself, made to happen: one key of a committed iteration replaced by
    another save's files (what a racing save on a store without create-if-absent can leave)."""
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    with Checkpointer(backend.url, backend.storage_options) as ckpt:
        ckpt.save(ITERATION, **_state(0, 0))
    other = backend.sub("other")
    with Checkpointer(other, backend.storage_options) as ckpt:
        ckpt.save(ITERATION, **_state(1, 0))
    root = resolve(backend.url, backend.storage_options)
    fs = root.fs
    theirs = resolve(other, backend.storage_options).join(f"iter_{ITERATION:09d}", "model")
    for name in fs.ls(theirs, detail=False):
        fs.cp_file(name, root.join(f"iter_{ITERATION:09d}", "model", name.rsplit("/", 1)[-1]))
    fs.invalidate_cache()
    target = _empty_like(_state(0, 0))
    with (
        Checkpointer(backend.url, backend.storage_options) as ckpt,
        pytest.raises(CorruptCheckpointError) as raised,
    ):
        ckpt.load(**target)
    assert backend.url in str(raised.value) and "another" in str(raised.value)
    assert _equal(target, _empty_like(_state(0, 0))), "a key was loaded from a folder that mixes two saves"
    assert pointer.read_pointer(root) == ITERATION


@pytest.mark.parametrize("backend_name", ["gcs", "azure", "sftp"])
def test_a_folder_whose_data_file_another_save_overwrote_is_never_loaded(
    backend_name: str, request: pytest.FixtureRequest
) -> None:
    """What two racing processes leave on a store without create-if-absent across processes: the
    loser's data files written into the winner's folder. Each save names them with its token
    there, so they land beside the winner's, never over them, and the winner's checkpoint loads
    bit-exact (before, both used torch's fixed names: a mix loaded on GCS).

    Guarantee row: 'two processes saving the *same* iteration into one folder never commit a mix' (GCS, Azure, SFTP)
    """
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    with Checkpointer(backend.url, backend.storage_options) as ckpt:
        ckpt.save(ITERATION, **_state(1, 0))
    other = backend.sub("other")
    with Checkpointer(other, backend.storage_options) as ckpt:
        ckpt.save(ITERATION, **_state(0, 0))
    root = resolve(backend.url, backend.storage_options)
    fs = root.fs
    theirs = resolve(other, backend.storage_options).join(f"iter_{ITERATION:09d}", "model")
    copied = [name for name in fs.ls(theirs, detail=False) if name.endswith(".distcp")]
    ours = root.join(f"iter_{ITERATION:09d}", "model")
    shared = {n.rsplit("/", 1)[-1] for n in copied} & {
        n.rsplit("/", 1)[-1] for n in fs.ls(ours, detail=False)
    }
    assert copied and not shared, f"two saves wrote data files of the same names: {sorted(shared)}"
    for name in copied:
        fs.cp_file(name, posixpath.join(ours, name.rsplit("/", 1)[-1]))
    fs.invalidate_cache()
    target = _empty_like(_state(1, 0))
    with Checkpointer(backend.url, backend.storage_options) as ckpt:
        ckpt.load(**target)
    assert _equal(target, _state(1, 0)), f"a mix of two saves loaded: {_summary(target)}"
