"""What ``dcp-fsspec`` prints when things go right: sizes a person reads, an optimizer's
param_groups in one line, checkpoints counted as the user saved them, a dry run that says it
deleted nothing, a progress bar that ends on 100% with a rate, and plain-text help."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch

from dcp_fsspec import Checkpointer, cli
from dcp_fsspec.tools.progress import Progress
from tests.conftest import Backend
from tests.helpers import save
from tests.test_verify import _run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_summarizes_param_groups_in_one_line_instead_of_a_row_per_setting(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1])
    code, out, _ = _cli(capsys, "inspect", memory_backend.url)
    assert code == 0
    assert not [line for line in out.splitlines() if line.startswith("param_groups.")]
    summary = next(line for line in out.splitlines() if line.startswith("param_groups:"))
    # AdamW over the 4 parameters of Training's model, flattened to parameter names.
    assert "the settings of 4 parameters" in summary and "lr" in summary and "betas" in summary
    key = next(
        k
        for k in json.loads(_cli(capsys, "inspect", memory_backend.url, "--json")[1])["keys"]
        if k["key"] == "optim"
    )
    assert key["param_groups"]["count"] == 4 and "weight_decay" in key["param_groups"]["keys"]
    assert key["param_groups"]["entries"] == len(
        [e for e in key["entries"] if e["fqn"].startswith("param_groups.")]
    )


def test_inspect_prints_sizes_in_kib_mib_gib(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    save({"big": torch.zeros(512, 512), "small": torch.zeros(3)}, memory_backend)
    code, out, _ = _cli(capsys, "inspect", memory_backend.url)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("big ", "small "))}
    assert code == 0 and rows["big"][-3:] == ["1.0", "MiB", "1"] and rows["small"][-2:] == ["12", "1"]
    assert "1.0 MiB" in next(line for line in out.splitlines() if "tensors (" in line)


# -- verify --------------------------------------------------------------------------------------


def test_verify_counts_checkpoints_not_keys(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1, 2])
    code, out, _ = _cli(capsys, "verify", memory_backend.url)
    assert code == 0 and "OK " in out and "2 checkpoint(s) (8 keys)" in out
    code, out, _ = _cli(capsys, "verify", memory_backend.sub("iter_000000001"))
    assert code == 0 and "1 checkpoint(s) (4 keys)" in out
    code, out, _ = _cli(capsys, "verify", memory_backend.sub("iter_000000001", "model"))
    assert code == 0 and ": 1 checkpoint, " in out


# -- prune ---------------------------------------------------------------------------------------


def test_prune_dry_run_says_would_delete_and_that_nothing_was_deleted(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1, 2, 3])
    code, out, _ = _cli(capsys, "prune", memory_backend.url, "--keep", "1", "--dry-run")
    assert code == 0 and "would delete iter_000000001" in out and "would delete iter_000000002" in out
    assert "would keep iter_000000003" in out and "nothing was deleted" in out and "kept" not in out
    doc = json.loads(_cli(capsys, "prune", memory_backend.url, "--keep", "1", "--dry-run", "--json")[1])
    assert doc["dry_run"] and doc["would_delete"] == [1, 2] and doc["deleted"] == []
    with Checkpointer(memory_backend.url) as ckpt:
        assert ckpt.committed_iterations() == [1, 2, 3]


# -- progress ------------------------------------------------------------------------------------


def test_progress_shows_bytes_per_second_and_ends_on_100_percent() -> None:
    clock, stream = _Clock(), _Terminal()
    with Progress("verifying", stream=stream, clock=clock) as progress:
        progress.add_total(4 * 1024 * 1024)
        clock.now += 1
        progress.advance(1024 * 1024)
        clock.now += 1
        progress.advance(1024 * 1024)  # the total was an overestimate: the work ends here
    draws = stream.getvalue().split("\r")[1:]
    assert "25%" in draws[0] and "1.0 MiB/s" in draws[0]
    assert "100%" in draws[-1] and "2.0 MiB / 2.0 MiB" in draws[-1] and "1.0 MiB/s" in draws[-1]
    assert stream.getvalue().endswith("\n")


def test_progress_after_an_error_shows_how_far_it_got() -> None:
    stream = _Terminal()
    with pytest.raises(OSError), Progress("copying", 4096, stream=stream, clock=_Clock()) as progress:
        progress.advance(1024)
        raise OSError("disk full")
    assert " 25%" in stream.getvalue().split("\r")[-1]


@pytest.mark.parametrize("command", ["verify", "to-torch"])
def test_long_commands_draw_a_bar_that_reaches_100_percent_on_a_terminal(
    capsys: pytest.CaptureFixture[str],
    memory_backend: Backend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    _run(memory_backend, [1])
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    extra = [str(tmp_path / "out.pt")] if command == "to-torch" else []
    assert cli.main([command, memory_backend.sub("iter_000000001", "model"), *extra]) == 0
    last = terminal.getvalue().split("\r")[-1]
    assert "100%" in last and "/s" in last and last.endswith("\n")


# -- help ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", ["demo", "ls", "inspect", "verify", "cp", "prune", "to-torch", "to-safetensors"]
)
def test_subcommand_help_is_plain_text(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith(f"usage: dcp-fsspec {command}")
    assert "``" not in out and ":class:" not in out and ":func:" not in out and ":mod:" not in out
    assert "--debug" in out and "-v, --verbose" in out


def test_demo_help_describes_the_demo() -> None:
    text = cli.plain_text(
        "starts ``LocalS3Server``, saves with :class:`Checkpointer` and :func:`~a.b.verify`"
    )
    assert text == "starts LocalS3Server, saves with Checkpointer and verify"
