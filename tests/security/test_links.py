"""A symbolic link in a folder we own is removed itself, never followed: its target is another
run's, or nobody's business of ours.

Each test links a folder of ours to a committed iteration of another run, then runs one path
that deletes (prune, a save's retention, a take-over, a drain to the durable tier). The other run
must stay committed, byte for byte, and the link must be gone, with a warning naming it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from dcp_fsspec import Checkpointer, LocalTier, cli
from dcp_fsspec.checkpoint.commit import run_listing
from dcp_fsspec.checkpoint.commit.commit_record import read_commit_record
from dcp_fsspec.checkpoint.tiers import drain
from dcp_fsspec.storage.transport.urls import resolve

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SEVEN = "iter_000000007"


def _run(where: Path, *iterations: int, **options: object) -> None:
    with Checkpointer(str(where), **options) as ckpt:  # type: ignore[arg-type]
        for iteration in iterations:
            ckpt.save(iteration, model={"w": torch.full((4,), float(iteration))})


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def other(tmp_path: Path) -> Path:
    """Another run's save_dirname, with iteration 7 committed."""
    _run(tmp_path / "other", 7)
    return tmp_path / "other"


def _assert_untouched(other: Path, before: dict[str, bytes]) -> None:
    assert _files(other / SEVEN) == before
    assert run_listing.committed_iterations(resolve(str(other))) == [7]


def _assert_link_removed(link: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert not link.is_symlink()
    assert any(str(link) in r.getMessage() and "symbolic link" in r.getMessage() for r in caplog.records), (
        caplog.text
    )


def test_prune_removes_a_link_to_another_runs_iteration_and_leaves_that_iteration_committed(
    tmp_path: Path, other: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    _run(run, 8, 9)
    (run / SEVEN).symlink_to(other / SEVEN)
    before = _files(other / SEVEN)
    with caplog.at_level(logging.WARNING):
        assert cli.main(["prune", str(run), "--keep", "1"]) == 0
    _assert_untouched(other, before)
    _assert_link_removed(run / SEVEN, caplog)
    assert not os.path.lexists(run / SEVEN)
    assert run_listing.committed_iterations(resolve(str(run))) == [9]


def test_a_saves_retention_removes_a_link_to_another_runs_iteration_and_leaves_that_iteration_committed(
    tmp_path: Path, other: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    _run(run, 6, 8)
    (run / SEVEN).symlink_to(other / SEVEN)
    # A link deeper in, where a key folder was: removed with its iteration, never followed.
    (run / "iter_000000006" / "model").rename(tmp_path / "moved")
    (run / "iter_000000006" / "model").symlink_to(other / SEVEN / "model")
    before = _files(other / SEVEN)
    with caplog.at_level(logging.WARNING):
        _run(run, 9, keep_last_n=1)
    assert not os.path.lexists(run / "iter_000000006")
    _assert_untouched(other, before)
    _assert_link_removed(run / SEVEN, caplog)
    assert not os.path.lexists(run / SEVEN)
    assert run_listing.committed_iterations(resolve(str(run))) == [9]


@pytest.mark.parametrize("through", ["a take-over", "a drain from the local tier"])
def test_a_save_over_a_linked_iteration_folder_writes_a_folder_of_its_own_and_leaves_the_target(
    tmp_path: Path, other: Path, caplog: pytest.LogCaptureFixture, through: str
) -> None:
    run = tmp_path / "run"
    _run(run, 5)
    (run / SEVEN).symlink_to(other / SEVEN)
    before = _files(other / SEVEN)
    # Committed there but newer than this run's pointer: taken over; or the durable copy's folder.
    tier = {"local_tier": LocalTier(str(tmp_path / "local"))} if through.startswith("a drain") else {}
    with caplog.at_level(logging.WARNING):
        _run(run, 7, **tier)
    _assert_untouched(other, before)
    _assert_link_removed(run / SEVEN, caplog)
    assert (run / SEVEN).is_dir()
    assert run_listing.committed_iterations(resolve(str(run))) == [5, 7]


def test_a_drains_other_rank_removes_a_link_standing_for_the_durable_iteration_folder_before_it_writes(
    tmp_path: Path, other: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run, local = tmp_path / "run", resolve(str(tmp_path / "local"))
    _run(tmp_path / "local", 7)  # a committed copy to drain, as a local tier holds one
    run.mkdir()
    (run / SEVEN).symlink_to(other / SEVEN)
    before = _files(other / SEVEN)
    job = drain.DrainJob(7, read_commit_record(local, 7).save_id)  # type: ignore[union-attr,arg-type]
    with caplog.at_level(logging.WARNING):
        drain.drain_iteration(local, resolve(str(run)), job, rank=1, world_size=2, keep_last_n=None)
    _assert_untouched(other, before)
    _assert_link_removed(run / SEVEN, caplog)
    assert (
        run / SEVEN / drain.marker_name(1)
    ).read_bytes() == job.token.encode()  # its marker, in a folder of its own
