"""The README's main job, ``python -m dcp_fsspec demo``, run as users run it: a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from dcp_fsspec import cli

REPO = Path(__file__).resolve().parents[1]
# Small enough to be quick, long enough to cross two checkpoints before the stop and one after.
SHORT = ["--steps", "60", "--every", "20", "--stop-at", "50", "--keep-last-n", "2"]


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "dcp_fsspec", "demo", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_demo_on_embedded_s3_resumes_bit_identically_and_says_the_checkpoints_go_with_the_server() -> None:
    done = _demo(*SHORT)
    assert done.returncode == 0, done.stdout + done.stderr
    # The first process starts a new run on purpose: nothing to resume is no warning there.
    assert "WARNING" not in done.stderr and "nothing to resume" not in done.stderr, done.stderr
    out = done.stdout
    assert "embedded S3 server (moto) at http://127.0.0.1:" in out
    assert "resumed from iteration 40" in out
    assert "bit-identical" in out and "MISMATCH" not in out
    table = out[out.index("iteration ") :]
    for name, who, kept in [
        ("iter_000000020", "first", "deleted"),
        ("iter_000000040", "first", "yes"),
        ("iter_000000060", "fresh", "yes"),
    ]:
        row = next(line for line in table.splitlines() if line.startswith(name))
        assert who in row and row.endswith(kept)
        assert " KiB " in row, row  # a deleted iteration's size too: measured when it was saved
    # A tiny model's save is fixed cost: a MB/s column would read as the library's throughput.
    assert "MB/s" not in out and "`make bench` measures throughput" in out
    closing = out[out.index("bit-identical") :]
    assert "embedded S3 server has stopped" in closing and "--url" in closing


# A second whole demo (~8 s): CI only. The demo on embedded S3 above keeps the run, the resume and
# the retention in `make test`; only `--url` is left to `make test SLOW=1`.
@pytest.mark.slow
def test_demo_checkpoints_to_any_url_given(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    done = _demo("--url", url, *SHORT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bit-identical" in done.stdout and f"the checkpoints stay at {url}" in done.stdout
    assert (tmp_path / "ckpt" / "latest_checkpoint.txt").read_text() == "iter_000000060\n"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "iter_000000040",
        "iter_000000060",
        "latest_checkpoint.txt",
    ]


def test_demo_refuses_a_url_that_already_holds_checkpoints(tmp_path: Path) -> None:
    fs = fsspec.filesystem("file")
    fs.makedirs(str(tmp_path / "ckpt"), exist_ok=True)
    fs.pipe_file(str(tmp_path / "ckpt" / "latest_checkpoint.txt"), b"iter_000000020\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--url", str(tmp_path / "ckpt")])
    assert str(tmp_path / "ckpt") in str(info.value.code)


def test_demo_refuses_memory_urls_which_a_fresh_process_cannot_see() -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--url", "memory://demo/ckpt"])
    assert "memory://demo/ckpt" in str(info.value.code)


@pytest.mark.parametrize("options", ["[1, 2]", "{not json"])
def test_demo_rejects_storage_options_that_are_not_a_json_object(
    options: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As every command does: a usage error (exit 2), one line naming the flag, before any work."""
    assert cli.main(["demo", "--url", "s3://bucket/x", "--storage-options", options]) == 2
    assert "--storage-options" in capsys.readouterr().err


def test_command_line_requires_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2 and "demo" in capsys.readouterr().err
