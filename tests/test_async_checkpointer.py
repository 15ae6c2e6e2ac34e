"""Asynchronous saves: training blocks only while state is staged; a background process writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from dcp_fsspec import BackgroundSaveError, Checkpointer, FsspecStorageReader, StorageError
from dcp_fsspec.checkpoint.save.staging import Stager
from tests.async_child import STEP1, STEP2, STOP_AT_ENV
from tests.ckpt_fsdp import Phase, run_phase
from tests.ckpt_helpers import Training, assert_equal, assert_same_training
from tests.conftest import BACKENDS, Backend

ASYNC = "async_with_pinned_mem"
pytestmark = pytest.mark.timeout(240)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_until_gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


# The background process reaches a store the way a synchronous save does, which the shared suites
# check on every backend; on the emulated ones (GCS, Azure, SFTP: ~5 s a test) these two run
# under `slow` only, and local disk, memory:// and S3 keep them in `make test`.
@pytest.fixture(
    params=[pytest.param(b, marks=pytest.mark.slow) if b in ("gcs", "azure", "sftp") else b for b in BACKENDS]
)
def async_backend(request: pytest.FixtureRequest) -> Backend:
    """Every backend; the emulated ones marked slow."""
    return request.getfixturevalue(f"{request.param}_backend")


def test_async_save_and_resume_match_uninterrupted_training(async_backend: Backend) -> None:
    reference = Training(seed=3)
    reference.run(6)

    training = Training(seed=3)
    with Checkpointer(async_backend.url, async_backend.storage_options, async_mode=ASYNC) as ckpt:
        for _ in range(2):
            training.run(2)
            ckpt.save(training.trainer["step"], **training.keys())
    resumed = Training(seed=99)
    with Checkpointer(async_backend.url, async_backend.storage_options) as ckpt:
        assert ckpt.load(**resumed.keys()) == 4
        assert ckpt.latest_checkpoint() == "iter_000000004"
    resumed.after_load()
    resumed.run(2)
    assert_same_training(resumed, reference)


def test_back_to_back_saves_both_land_and_the_pointer_ends_on_the_newest(async_backend: Backend) -> None:
    with Checkpointer(async_backend.url, async_backend.storage_options, async_mode=ASYNC) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, trainer={"w": torch.full((50_000,), float(step))})
        ckpt.wait()
        assert ckpt.committed_iterations() == [1, 2, 3]
        assert ckpt.latest_checkpoint() == "iter_000000003"
    for step in (1, 2, 3):
        target = {"w": torch.zeros(50_000)}
        reader = FsspecStorageReader(
            f"{async_backend.url}/iter_{step:09d}/trainer", storage_options=async_backend.storage_options
        )
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert torch.equal(target["w"], torch.full((50_000,), float(step)))


def test_save_returns_before_the_write_and_the_staged_copy_is_isolated(local_backend: Backend) -> None:
    state = {"w": torch.arange(10.0)}
    with Checkpointer(local_backend.url, async_mode=ASYNC) as ckpt:
        ckpt.save(1, trainer=state)
        state["w"].add_(100)  # training goes on right away; the save must keep the staged values
        ckpt.wait()
    target = {"w": torch.zeros(10)}
    with Checkpointer(local_backend.url) as ckpt:
        assert ckpt.load(trainer=target) == 1
    assert torch.equal(target["w"], torch.arange(10.0))


def test_two_keys_of_the_same_shape_keep_their_own_values_and_buffers(local_backend: Backend) -> None:
    """Each key is staged into buffers of its own, kept from save to save."""
    with Checkpointer(local_backend.url, async_mode=ASYNC) as ckpt:
        for step in (1, 2):
            ckpt.save(
                step, first={"w": torch.full((8,), 1.0 * step)}, second={"w": torch.full((8,), -1.0 * step)}
            )
            ckpt.wait()
        assert ckpt._async is not None and ckpt._async._stager is not None
        assert ckpt._async._stager.staged_bytes == 2 * 8 * 4
    with Checkpointer(local_backend.url) as ckpt:
        first, second = {"w": torch.zeros(8)}, {"w": torch.zeros(8)}
        assert ckpt.load(first=first, second=second) == 2
    assert torch.equal(first["w"], torch.full((8,), 2.0)) and torch.equal(second["w"], torch.full((8,), -2.0))


def test_an_error_in_the_background_surfaces_at_the_next_call(s3_backend: Backend) -> None:
    url = "s3://no-such-bucket-for-async/run"
    ckpt = Checkpointer(url, s3_backend.storage_options, async_mode=ASYNC)
    ckpt.save(1, trainer={"w": torch.ones(4)})  # returns: the failure happens in the background
    with pytest.raises(StorageError) as info:
        ckpt.wait()
    assert "no-such-bucket-for-async" in str(info.value)
    ckpt.save(2, trainer={"w": torch.ones(4)})  # accepted again; its failure surfaces at the next save
    with pytest.raises(StorageError):
        ckpt.save(3, trainer={"w": torch.ones(4)})
    ckpt.save(4, trainer={"w": torch.ones(4)})  # ... or at finalize
    with pytest.raises(StorageError):
        ckpt.finalize()
    assert ckpt._async is not None and ckpt._async.saver is None  # stopped even though the last save failed


def test_a_dead_background_process_is_reported_not_waited_for(local_backend: Backend) -> None:
    ckpt = Checkpointer(local_backend.url, async_mode=ASYNC)
    ckpt.save(1, trainer={"w": torch.ones(4)})
    ckpt.wait()
    pid = ckpt._async.saver.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGKILL)
    assert _wait_until_gone(pid)
    with pytest.raises(BackgroundSaveError, match="died") as info:
        ckpt.save(2, trainer={"w": torch.ones(4)})
        ckpt.wait()
    assert local_backend.url in str(info.value)
    ckpt.save(3, trainer={"w": torch.ones(4)})  # a new background process takes over
    ckpt.finalize()
    assert Checkpointer(local_backend.url).latest_checkpoint() == "iter_000000003"


def test_finalize_waits_and_leaves_no_process_behind(local_backend: Backend) -> None:
    ckpt = Checkpointer(local_backend.url, async_mode=ASYNC)
    ckpt.save(7, trainer={"w": torch.randn(100_000)})
    pid = ckpt._async.saver.pid  # type: ignore[union-attr]
    ckpt.finalize()
    assert _gone(pid)
    assert Checkpointer(local_backend.url).latest_checkpoint() == "iter_000000007"


def test_the_background_process_is_running_right_after_construction(local_backend: Backend) -> None:
    with Checkpointer(local_backend.url, async_mode=ASYNC) as ckpt:
        assert ckpt._async is not None and ckpt._async.saver is not None
        assert not _gone(ckpt._async.saver.pid)  # type: ignore[union-attr,arg-type]


def test_a_checkpointer_finalized_without_a_save_leaves_no_process_and_nothing_saved(
    local_backend: Backend,
) -> None:
    ckpt = Checkpointer(local_backend.url, async_mode=ASYNC)
    pid = ckpt._async.saver.pid  # type: ignore[union-attr]
    ckpt.finalize()
    assert _wait_until_gone(pid, within=5.0)  # type: ignore[arg-type]
    assert Checkpointer(local_backend.url).committed_iterations() == []


def test_an_unguarded_script_is_built_at_once_and_its_first_save_says_what_to_add(tmp_path: Path) -> None:
    """Construction does not wait for the background process; the save that needs it does."""
    url = str(tmp_path / "run")
    script = tmp_path / "train_unguarded.py"
    script.write_text(
        "import torch\n"
        "from dcp_fsspec import Checkpointer\n"
        f"ckpt = Checkpointer({url!r}, async_mode={ASYNC!r})\n"
        "print('BUILT', flush=True)\n"
        "ckpt.save(1, trainer={'w': torch.ones(4)})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=200, check=False
    )
    assert done.returncode != 0 and done.stdout.count("BUILT") == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("dcp_fsspec.errors.BackgroundSaveError") and url in last, done.stderr[-3000:]
    assert 'if __name__ == "__main__":' in last and str(script) in last


def test_a_prepared_state_saves_and_loads_bit_exact(local_backend: Backend) -> None:
    training = Training(seed=5)
    training.run(2)
    with Checkpointer(local_backend.url, async_mode=ASYNC) as ckpt:
        ckpt.prepare(**training.keys())
        training.run(1)  # training goes on while the buffers are allocated
        ckpt.save(3, **training.keys())
    resumed = Training(seed=77)
    with Checkpointer(local_backend.url) as ckpt:
        assert ckpt.load(**resumed.keys()) == 3
    assert_equal(resumed.model.state_dict(), training.model.state_dict())
    assert_equal(resumed.optim.state_dict(), training.optim.state_dict())


def test_prepared_buffers_reach_the_background_process_before_the_first_save(local_backend: Backend) -> None:
    training = Training(seed=6)
    training.run(2)
    with Checkpointer(local_backend.url, async_mode=ASYNC) as ckpt:
        ckpt.prepare(**training.keys())
        saver = ckpt._async.saver
        saver._join_hand_over()  # the hand-over thread is done: the buffers are on the other side
        sent_at_save = []
        pack = saver._handles.pack

        def spy(staged: Any) -> Any:
            packed, used = pack(staged)
            sent_at_save.extend(
                v for v in torch.utils._pytree.tree_leaves(packed) if type(v).__name__ == "_New"
            )
            return packed, used

        saver._handles.pack = spy
        training.run(1)
        ckpt.save(3, **training.keys())
        ckpt.wait()
    assert sent_at_save == []  # the first save sent tokens only
    resumed = Training(seed=78)
    with Checkpointer(local_backend.url) as ckpt:
        assert ckpt.load(**resumed.keys()) == 3
    assert_equal(resumed.model.state_dict(), training.model.state_dict())
    assert_equal(resumed.optim.state_dict(), training.optim.state_dict())


def test_prepare_before_the_first_step_leaves_training_as_it_would_have_been(local_backend: Backend) -> None:
    prepared, plain = Training(seed=9), Training(seed=9)
    with Checkpointer(local_backend.url, async_mode=ASYNC) as ckpt:
        ckpt.prepare(**prepared.keys())  # a fresh run: the optimizer has not stepped yet
        prepared.run(3)
        plain.run(3)
        ckpt.save(3, **prepared.keys())
    assert_same_training(prepared, plain)


def test_prepare_refuses_a_bad_key_and_a_finalized_checkpointer_naming_the_url(
    local_backend: Backend,
) -> None:
    ckpt = Checkpointer(local_backend.url, async_mode=ASYNC)
    with pytest.raises(ValueError, match="bad/key"):
        ckpt.prepare(**{"bad/key": {"w": torch.ones(2)}})
    ckpt.finalize()
    with pytest.raises(RuntimeError) as info:
        ckpt.prepare(trainer={"w": torch.ones(2)})
    assert local_backend.url in str(info.value)


def test_prepare_without_async_saves_changes_nothing(local_backend: Backend) -> None:
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.prepare(trainer={"w": torch.ones(2)})
        assert ckpt.committed_iterations() == []


# On S3 (~6.5 s each) under `slow` only: the kill and the cleanup are the same on every store; what
# S3 adds, aborting the killed save's multipart uploads, is then checked in CI.
@pytest.mark.parametrize(
    "shared_backend", ["local", pytest.param("s3", marks=pytest.mark.slow)], indirect=True
)
@pytest.mark.parametrize("phase", ["before-commit", "after-commit"])
def test_a_killed_training_process_leaves_a_whole_checkpoint_and_no_orphan(
    shared_backend: Backend, tmp_path: Path, phase: str
) -> None:
    env = {**os.environ, STOP_AT_ENV: f"{phase}:{tmp_path}"}
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.async_child",
            shared_backend.url,
            json.dumps(shared_backend.storage_options),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        env=env,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("SAVING"), line
        background_pid = int(line.split()[1])
        deadline = time.monotonic() + 120
        while not (tmp_path / phase).exists():  # the background process reached the phase
            assert time.monotonic() < deadline and child.poll() is None, f"never reached {phase}"
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait()
    killed = time.monotonic()
    assert _wait_until_gone(background_pid, within=5.0), (
        "the background process outlived its training process"
    )
    assert time.monotonic() - killed < 2.0  # it watches its parent every 0.2 s

    with Checkpointer(shared_backend.url, shared_backend.storage_options) as ckpt:
        target = {"w": torch.zeros(1000)}
        if phase == "before-commit":
            assert ckpt.latest_checkpoint() == "iter_000000001" and ckpt.committed_iterations() == [1]
            assert ckpt.load(trainer=target) == 1 and torch.equal(target["w"], STEP1["w"])
            # The resumed run saves iteration 2 again: what the killed save left is cleared first.
            ckpt.save(2, trainer={"w": torch.full((1000,), 7.0)})
            assert ckpt.load(trainer=target) == 2 and torch.equal(target["w"], torch.full((1000,), 7.0))
        else:
            assert ckpt.latest_checkpoint() == "iter_000000002" and ckpt.committed_iterations() == [1, 2]
            assert ckpt.load(trainer=target) == 2 and torch.equal(target["w"], STEP2["w"])
        ckpt.save(3, trainer={"w": torch.ones(2)})
        assert ckpt.committed_iterations() == [1, 2, 3] and ckpt.latest_checkpoint() == "iter_000000003"


def test_staging_reuses_its_buffers_while_shapes_stay_the_same() -> None:
    stager = Stager()
    state = {"a": torch.randn(100), "nested": {"b": torch.randn(3, 4)}, "step": 1}
    first = stager.stage(state)
    second = stager.stage({"a": torch.randn(100), "nested": {"b": torch.randn(3, 4)}, "step": 2})
    assert first["a"].data_ptr() == second["a"].data_ptr()
    assert first["nested"]["b"].data_ptr() == second["nested"]["b"].data_ptr()
    assert second["a"].is_shared() and second["step"] == 2
    assert stager.staged_bytes == (100 + 12) * 4
    third = stager.stage({"a": torch.randn(200), "nested": {"b": torch.randn(3, 4)}, "step": 3})
    assert third["a"].data_ptr() != first["a"].data_ptr()
    assert stager.staged_bytes == (200 + 12) * 4  # the old buffer was dropped, not kept beside
    stager.close()


def test_prepared_buffers_hold_the_state_before_the_first_stage_and_are_reused_by_it() -> None:
    stager = Stager()
    state = {
        "a": torch.randn(1000),
        "nested": {"b": torch.randn(3, 4), "c": [torch.ones(5, dtype=torch.int64)]},
    }
    stager.prepare(state)
    assert stager.staged_bytes == (1000 + 12) * 4 + 5 * 8
    state["a"].add_(1)  # training changed the values after prepare: the stage copies the new ones
    staged = stager.stage(state)
    assert torch.equal(staged["a"], state["a"]) and torch.equal(staged["nested"]["c"][0], torch.ones(5))
    assert stager.staged_bytes == (1000 + 12) * 4 + 5 * 8  # prepare's buffers, not a second set
    assert staged["a"].data_ptr() == stager.stage(state)["a"].data_ptr()
    stager.close()
    assert stager.staged_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_into_pinned_shared_memory() -> None:
    stager = Stager()
    source = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda")}
    staged = stager.stage(source)
    assert staged["w"].device.type == "cpu" and staged["w"].is_shared() and staged["w"].is_pinned()
    assert torch.equal(staged["w"], source["w"].cpu()) and torch.equal(staged["b"], source["b"].cpu())
    source["w"].add_(1)
    again = stager.stage(source)
    assert again["w"].data_ptr() == staged["w"].data_ptr()
    assert torch.equal(again["w"], source["w"].cpu())
    stager.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prepared_buffers_of_cuda_tensors_are_pinned_shared_memory() -> None:
    stager = Stager()
    source = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda")}
    stager.prepare(source)
    staged = stager.stage(source)
    assert staged["w"].is_shared() and staged["w"].is_pinned()
    assert torch.equal(staged["w"], source["w"].cpu()) and torch.equal(staged["b"], source["b"].cpu())
    stager.close()


@pytest.mark.slow
def test_two_rank_fsdp2_async_saves_resume_bitwise(shared_backend: Backend, tmp_path: Path) -> None:
    def run(name: str, **kwargs: Any) -> dict[str, Any]:
        phase = Phase(
            url=shared_backend.url,
            storage_options=shared_backend.storage_options,
            world_size=2,
            init_file=str(tmp_path / f"init-{name}"),
            out_file=str(tmp_path / f"{name}.pt"),
            **kwargs,
        )
        mp.spawn(run_phase, args=(phase,), nprocs=2, join=True)
        return torch.load(phase.out_file, weights_only=False)

    first = run("first", expect_resume=0, stop_at=5, save_every=2, reference_steps=8, async_mode=ASYNC)
    assert first["latest"] == "iter_000000004"
    resumed = run("resumed", expect_resume=4, stop_at=8, save_every=2, async_mode=ASYNC)
    reference = torch.load(str(tmp_path / "first.pt.ref"), weights_only=False)
    for part in ("model", "optim", "scheduler", "step", "data_rng"):
        assert_equal(resumed[part], reference[part], part)
    assert resumed["losses"] == {s: reference["losses"][s] for s in (5, 6, 7, 8)}
