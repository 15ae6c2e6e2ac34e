"""A new user's first hour with the Checkpointer: nothing is lost or started over without a word.

Each test here failed on the main before it: a mistyped save_dirname trained from scratch
silently, an asynchronous save was lost when the script ended without ``finalize()``, a script
without a ``__main__`` guard got a misleading error, a doubled slash disabled retention, and
there was no way to resume an older iteration after the latest was damaged.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from dcp_fsspec import (
    Checkpointer,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    FsspecStorageReader,
    FsspecStorageWriter,
    InvalidURLError,
    ResumeOptions,
    StorageError,
)
from dcp_fsspec.checkpoint.commit import pointer
from tests.conftest import Backend

REPO = Path(__file__).resolve().parents[1]
LOGGER = "dcp_fsspec.checkpoint.checkpointer"


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), value)}


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"train_{uuid.uuid4().hex[:6]}.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240, check=False
    )


# -- starting from scratch ---------------------------------------------------------------------


def test_a_fresh_start_over_a_folder_with_uncommitted_iterations_is_a_warning_naming_the_url(
    local_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    (Path(local_backend.url) / "iter_000000010" / "model").mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="dcp_fsspec"), Checkpointer(local_backend.url) as ckpt:
        assert ckpt.load(trainer=_state(0.0)) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and local_backend.url in warnings[0].getMessage()
    assert (
        "iter_000000010" in warnings[0].getMessage() and "latest_checkpoint.txt" in warnings[0].getMessage()
    )


def test_a_fresh_start_over_a_folder_of_other_files_is_a_warning(
    local_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    Path(local_backend.url).mkdir(parents=True)
    (Path(local_backend.url) / "notes.txt").write_text("not a checkpoint")
    with caplog.at_level(logging.WARNING, logger="dcp_fsspec"), Checkpointer(local_backend.url) as ckpt:
        assert ckpt.load(trainer=_state(0.0)) == 0
    assert any("notes.txt" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_a_fresh_start_where_nothing_is_is_one_warning_naming_the_url(
    local_backend: Backend, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    if where == "empty":
        Path(local_backend.url).mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="dcp_fsspec"), Checkpointer(local_backend.url) as ckpt:
        assert ckpt.load(trainer=_state(0.0)) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and local_backend.url in warnings[0] and "training from scratch" in warnings[0]


def test_a_mistyped_s3_save_dirname_starts_fresh_with_a_warning_naming_it(
    s3_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    url = s3_backend.sub("killrn")
    with (
        caplog.at_level(logging.WARNING, logger="dcp_fsspec"),
        Checkpointer(url, s3_backend.storage_options) as ckpt,
    ):
        assert ckpt.load(trainer=_state(0.0)) == 0
    assert [
        r.getMessage() for r in caplog.records if url in r.getMessage() and "from scratch" in r.getMessage()
    ]


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_a_new_run_that_expects_nothing_to_resume_starts_fresh_with_no_warning_but_an_info_naming_the_url(
    local_backend: Backend, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    if where == "empty":
        Path(local_backend.url).mkdir(parents=True)
    new_run = ResumeOptions(missing_ok=True)
    with (
        caplog.at_level(logging.INFO, logger="dcp_fsspec"),
        Checkpointer(local_backend.url, resume=new_run) as ckpt,
    ):
        assert ckpt.load(trainer=_state(0.0)) == 0
        ckpt.save(5, trainer=_state(5.0))
        assert ckpt.load(trainer=_state(0.0)) == 5  # missing_ok never skips a checkpoint that is there
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(
        local_backend.url in r.getMessage() and "from scratch" in r.getMessage() for r in caplog.records
    )


def test_a_new_run_over_a_folder_with_uncommitted_iterations_is_still_a_warning(
    local_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    (Path(local_backend.url) / "iter_000000010" / "model").mkdir(parents=True)
    new_run = ResumeOptions(missing_ok=True)
    with (
        caplog.at_level(logging.WARNING, logger="dcp_fsspec"),
        Checkpointer(local_backend.url, resume=new_run) as ckpt,
    ):
        assert ckpt.load(trainer=_state(0.0)) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and local_backend.url in warnings[0] and "iter_000000010" in warnings[0]


def test_resume_options_refuse_both_required_and_missing_ok() -> None:
    with pytest.raises(ValueError, match="required=True, missing_ok=True"):
        ResumeOptions(required=True, missing_ok=True)


def test_resume_required_refuses_a_fresh_start_naming_the_url(local_backend: Backend) -> None:
    with Checkpointer(local_backend.url, resume=ResumeOptions(required=True)) as ckpt:
        with pytest.raises(CheckpointNotFoundError, match="nothing to resume") as raised:
            ckpt.load(trainer=_state(0.0))
        assert local_backend.url in str(raised.value) and "typo" in str(raised.value)
        ckpt.save(5, trainer=_state(5.0))
        assert ckpt.load(trainer=_state(0.0)) == 5


# -- an older iteration --------------------------------------------------------------------------


def test_load_of_an_older_committed_iteration_restores_it_and_returns_its_number(
    local_backend: Backend,
) -> None:
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(10, trainer=_state(10.0))
        ckpt.save(20, trainer=_state(20.0))
        target = _state(0.0)
        assert ckpt.load(iteration=10, trainer=target) == 10
        assert torch.equal(target["w"], _state(10.0)["w"])
        assert ckpt.load(trainer=target) == 20


def test_load_of_an_iteration_that_is_not_committed_names_the_url_and_the_committed_ones(
    local_backend: Backend,
) -> None:
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(10, trainer=_state(10.0))
        with pytest.raises(CheckpointNotFoundError) as raised:
            ckpt.load(iteration=15, trainer=_state(0.0))
    message = str(raised.value)
    assert "iter_000000015" in message and local_backend.url in message and "iter_000000010" in message
    assert "load(iteration=N)" in message and "rewrite" not in message


def test_a_damaged_latest_checkpoint_says_which_older_iteration_to_load_instead(
    local_backend: Backend,
) -> None:
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(10, trainer=_state(10.0))
        ckpt.save(20, trainer=_state(20.0))
    data = next((Path(local_backend.url) / "iter_000000020" / "trainer").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[raw.index(struct.pack("<64f", *[20.0] * 64))] ^= 0xFF  # the first byte of the tensor's data
    data.write_bytes(bytes(raw))
    with Checkpointer(local_backend.url) as ckpt, pytest.raises(CorruptCheckpointError) as raised:
        ckpt.load(trainer=_state(0.0))
    assert "load(iteration=10" in str(raised.value)
    assert isinstance(raised.value, ChecksumMismatchError)


# -- URLs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [Checkpointer, FsspecStorageWriter])
def test_a_url_with_a_doubled_slash_is_refused_naming_the_fixed_url(make: type) -> None:
    with pytest.raises(InvalidURLError) as raised:
        make("s3://runs//exp4")
    assert "s3://runs/exp4" in str(raised.value) and "s3://runs//exp4" in str(raised.value)


def test_a_missing_bucket_is_named_as_such_on_save_and_on_load(s3_backend: Backend) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    with Checkpointer(url, s3_backend.storage_options) as ckpt:
        with pytest.raises(StorageError) as saving:
            ckpt.save(1, trainer=_state(1.0))
        with pytest.raises(StorageError) as loading:
            ckpt.load(trainer=_state(0.0))
    with pytest.raises(CheckpointNotFoundError) as reading:  # dcp.load with our reader: nothing at the URL
        FsspecStorageReader(url, storage_options=s3_backend.storage_options).read_metadata()
    for raised in (saving, loading, reading):
        assert "bucket does not exist" in str(raised.value) and url.split("/run")[0] in str(raised.value)


# -- asynchronous saves at exit ------------------------------------------------------------------


def test_an_async_save_in_flight_when_the_script_ends_is_committed_and_logged(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    done = _script(
        tmp_path,
        f"""
        import logging
        import torch
        from dcp_fsspec import Checkpointer

        if __name__ == "__main__":
            logging.basicConfig(level=logging.WARNING)
            ckpt = Checkpointer({url!r}, async_mode="async_with_pinned_mem")
            ckpt.save(7, trainer={{"w": torch.arange(4_000_000, dtype=torch.float32)}})
            # no finalize(), no with block: the script simply ends
    """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iteration 7" in done.stderr and url in done.stderr
    from dcp_fsspec.storage.transport.urls import resolve

    assert pointer.read_pointer(resolve(url)) == 7


def test_an_async_checkpointer_in_a_script_without_a_main_guard_says_what_to_add_in_one_traceback(
    tmp_path: Path,
) -> None:
    """The background process re-runs the script and exits quietly: no nested spawn's
    RuntimeError, no EOFError, only the training process's one error naming the script."""
    done = _script(
        tmp_path,
        f"""
        import torch
        from dcp_fsspec import Checkpointer

        ckpt = Checkpointer({str(tmp_path / "run")!r}, async_mode="async_with_pinned_mem")
        ckpt.save(1, trainer={{"w": torch.ones(4)}})
        ckpt.finalize()
    """,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert "BackgroundSaveError" in lines[-1] and 'if __name__ == "__main__":' in lines[-1], done.stderr[
        -3000:
    ]
    assert "train_" in lines[-1] and str(tmp_path / "run") in lines[-1]
    assert sum(line.startswith("Traceback") for line in lines) == 1, done.stderr[-3000:]
    assert "RuntimeError" not in done.stderr and "EOFError" not in done.stderr


def test_an_async_checkpointer_never_finalized_warns_when_collected(memory_backend: Backend) -> None:
    ckpt = Checkpointer(memory_backend.url, async_mode="async_with_pinned_mem")
    ckpt.save(1, trainer=_state(1.0))
    ckpt.wait()
    with pytest.warns(ResourceWarning, match="never finalized"):
        ckpt.__del__()
    ckpt.finalize()


def test_async_commits_and_retention_deletions_are_logged_in_the_training_process(
    local_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="dcp_fsspec"):
        with Checkpointer(local_backend.url, async_mode="async_with_pinned_mem", keep_last_n=1) as ckpt:
            ckpt.save(1, trainer=_state(1.0))
            ckpt.save(2, trainer=_state(2.0))
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "committed" in m and "iter_000000002" in m and "background save process" in m for m in messages
    )
    assert any("deleted" in m and "iter_000000001" in m and "background save process" in m for m in messages)


# -- noise ---------------------------------------------------------------------------------------


def test_a_single_process_save_and_load_print_no_torch_notice(tmp_path: Path) -> None:
    done = _script(
        tmp_path,
        f"""
        import torch
        import torch.distributed.checkpoint as dcp
        from dcp_fsspec import Checkpointer, FsspecStorageReader, FsspecStorageWriter

        with Checkpointer({str(tmp_path / "run")!r}) as ckpt:
            ckpt.save(1, trainer={{"w": torch.ones(4)}})
            ckpt.load(trainer={{"w": torch.zeros(4)}})
        dcp.save({{"w": torch.ones(4)}}, storage_writer=FsspecStorageWriter({str(tmp_path / "plain")!r}))
        dcp.load({{"w": torch.zeros(4)}}, storage_reader=FsspecStorageReader({str(tmp_path / "plain")!r}))
        import warnings
        warnings.warn("other warnings still show")
    """,
    )
    assert done.returncode == 0, done.stderr
    assert "torch.distributed is disabled" not in done.stderr
    assert "other warnings still show" in done.stderr
