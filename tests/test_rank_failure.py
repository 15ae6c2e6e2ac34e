"""Failure across ranks: when one rank of a save fails, every rank gets an error, in bounded time.

Two real ranks (gloo). A rank whose storage fails, or that raises while staging, or a rank 0
that fails to commit: DCP and the checkpointer's own collectives carry the error to every rank
at once. A rank that is killed: gloo sees the connection reset at once. A rank that hangs: only
the process group's timeout can end the wait, so the group must have one shorter than "forever"
(``init_process_group(timeout=...)`` or ``Checkpointer(process_group=new_group(timeout=...))``).
In every case the pointer stays on the last committed iteration.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dcp_fsspec import Checkpointer, StorageError
from dcp_fsspec.checkpoint.commit import committing as commit
from dcp_fsspec.storage.backends.local import LocalBackend
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME
from dcp_fsspec.storage.write import writer as writer_module
from tests.conftest import Backend
from tests.distributed import run_ranks

pytestmark = pytest.mark.timeout(240)

# The process group timeout for the hung-rank case: what bounds the wait for a rank that hangs.
HUNG_RANK_TIMEOUT = timedelta(seconds=8)


def _state(rank: int, iteration: int) -> dict[str, Any]:
    # Names differ per rank, so each rank writes data files of its own.
    return {f"rank{rank}": torch.full((1024,), float(iteration)), "step": iteration}


@contextmanager
def _storage_fails(on_this_rank: bool) -> Iterator[None]:
    """Every data file this rank writes fails to publish (a full disk, a refused upload)."""
    real = LocalBackend.new_upload

    class Refused:
        """An upload that takes every byte, then fails to publish the file."""

        def __init__(self, upload: Any) -> None:
            self._upload = upload

        def __getattr__(self, name: str) -> Any:
            return getattr(self._upload, name)

        def commit(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device", self._upload.path)

    def failing_upload(self: LocalBackend, path: str, **kwargs: Any) -> Any:
        return Refused(real(self, path, **kwargs))

    with pytest.MonkeyPatch.context() as patch:
        if on_this_rank:
            patch.setattr(LocalBackend, "new_upload", failing_upload)
        yield


@contextmanager
def _commit_record_fails(on_this_rank: bool) -> Iterator[None]:
    # The commit record is written by a create-if-absent or, after a take-over, by replacing
    # the save's own mark: fail it where both go through, at the record's write.
    def failing(root: Any, iteration: int, *args: Any, **kwargs: Any) -> None:
        path = root.join(f"iter_{iteration:09d}", COMMIT_RECORD_NAME)
        raise StorageError(f"cannot write {root.url_of(path)}: [Errno 5] Input/output error")

    with pytest.MonkeyPatch.context() as patch:
        if on_this_rank:
            patch.setattr(commit, "commit_record", failing)
        yield


def _fail_one_rank_at_each_step(rank: int, world_size: int, url: str, options: dict[str, Any]) -> None:
    with Checkpointer(url, options) as ckpt:
        # "run" holds one replicated value, which DCP gives to one rank: the other writes nothing.
        ckpt.save(1, state=_state(rank, 1), run={"seed": 1234})

        with _storage_fails(rank == 1), pytest.raises(StorageError) as info:
            ckpt.save(2, state=_state(rank, 2))
        assert url in str(info.value) and "No space left on device" in str(info.value)
        assert ckpt.latest_checkpoint() == "iter_000000001"

        with pytest.raises(TypeError, match="'state'"):
            ckpt.save(2, state=_state(rank, 2) if rank == 0 else object())
        assert ckpt.latest_checkpoint() == "iter_000000001"

        with _commit_record_fails(rank == 0), pytest.raises(StorageError) as info:
            ckpt.save(2, state=_state(rank, 2))
        assert url in str(info.value) and COMMIT_RECORD_NAME in str(info.value)
        assert ckpt.latest_checkpoint() == "iter_000000001" and ckpt.committed_iterations() == [1]

        ckpt.save(2, state=_state(rank, 2))  # the failures left nothing in the way
        assert ckpt.latest_checkpoint() == "iter_000000002" and ckpt.committed_iterations() == [1, 2]
        target: dict[str, Any] = {f"rank{rank}": torch.zeros(1024), "step": 0}
        assert ckpt.load(state=target) == 2
        assert target["step"] == 2 and torch.equal(target[f"rank{rank}"], torch.full((1024,), 2.0))


def test_one_rank_failing_at_any_step_fails_the_save_on_every_rank_and_the_pointer_stays(
    local_backend: Backend, tmp_path: Path
) -> None:
    """Guarantee row: 'one rank failing (storage error, exception, commit error) fails the save on every rank at once; the pointer stays' (local)"""
    # Local disk only: how errors travel between ranks does not depend on the storage.
    run_ranks(_fail_one_rank_at_each_step, 2, tmp_path, local_backend.url, local_backend.storage_options)


# -- a rank that dies or hangs -----------------------------------------------------------------


def _save_while_rank1_dies(rank: int, store: str, url: str, how: str, timeout: float, report: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    group_timeout = timedelta(seconds=timeout)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=group_timeout
    )
    ckpt = Checkpointer(url)
    ckpt.save(1, state=_state(rank, 1))
    if rank == 1:

        def dies(*args: Any, **kwargs: Any) -> Any:
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait()  # hangs, as on a stuck mount or a deadlocked library

        pytest.MonkeyPatch().setattr(writer_module.FsspecStorageWriter, "write_data", dies)
    start = time.monotonic()
    try:
        ckpt.save(2, state=_state(rank, 2))
        outcome, from_the_group = "saved", False
    except Exception as e:  # noqa: BLE001 - reported to the test
        # gloo's error for a peer that reset its connection or did not answer in time.
        outcome, from_the_group = f"{type(e).__name__}: {e}", isinstance(e, RuntimeError)
    with open(report, "w") as f:
        json.dump(
            {"outcome": outcome, "from_the_group": from_the_group, "seconds": time.monotonic() - start}, f
        )
    os._exit(0)  # no destroy_process_group: its peer is gone


@pytest.mark.parametrize("how", ["killed", "hung"])
@pytest.mark.slow
def test_when_a_rank_is_killed_or_hangs_mid_save_the_other_rank_fails_in_bounded_time(
    local_backend: Backend, tmp_path: Path, how: str
) -> None:
    """Guarantee row: 'a rank killed or hung mid-save ends the save on the others in bounded time; the pointer stays' (local)"""
    # A killed rank is seen at once (its sockets reset), whatever the timeout; a hung one only
    # when the group's timeout passes.
    timeout = 120.0 if how == "killed" else HUNG_RANK_TIMEOUT.total_seconds()
    store, report = str(tmp_path / "store"), str(tmp_path / "rank0.json")
    ctx = mp.get_context("spawn")
    ranks = [
        ctx.Process(
            target=_save_while_rank1_dies, args=(rank, store, local_backend.url, how, timeout, report)
        )
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        ranks[0].join(timeout=timeout + 120)
        assert ranks[0].exitcode == 0, f"rank 0 did not report (exit code {ranks[0].exitcode})"
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
    with open(report) as f:
        result = json.load(f)
    assert result["from_the_group"], result
    if how == "killed":
        # Seen from the reset connection, not the group's timeout: that would take `timeout`.
        assert result["seconds"] < timeout, result
    else:
        # Only the group's timeout can end it (a hung peer resets nothing); generous above.
        assert 0.9 * timeout <= result["seconds"] < timeout + 60, result
    with Checkpointer(local_backend.url) as ckpt:
        assert ckpt.latest_checkpoint() == "iter_000000001" and ckpt.committed_iterations() == [1]
