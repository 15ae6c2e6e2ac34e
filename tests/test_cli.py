"""The ``dcp-fsspec`` command line, run as users run it: ``cli.main([...])``, and once as a process.

Each subcommand is checked for what it prints (text and ``--json``), its exit code, and that
errors name the URL. Checkpoints are real ones written by the Checkpointer, on memory:// and on
local disk (and S3 for copies across stores).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_fsspec import Checkpointer, cli, verify
from dcp_fsspec.storage.format import names
from dcp_fsspec.storage.format.names import temporary_path
from dcp_fsspec.tools.progress import Progress
from tests.ckpt_helpers import Training, assert_equal
from tests.conftest import Backend
from tests.test_verify import _flip_tensor_byte, _run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

REPO = Path(__file__).resolve().parents[1]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = _cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def _uncommit(backend: Backend, iteration: str) -> None:
    backend.fs.rm_file(backend.fs._strip_protocol(backend.sub(iteration, ".commit.json")))


# -- help, exit codes, the process ---------------------------------------------------------------


def test_help_lists_every_subcommand_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for command in ("ls", "inspect", "verify", "cp", "prune", "to-torch", "to-safetensors", "demo"):
        assert command in out
    for code in range(6):
        assert f"\n  {code}  " in out


def test_python_dash_m_runs_verify_and_prints_json(tmp_path: Path) -> None:
    backend = Backend("local", str(tmp_path / "run"))
    _run(backend, [1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "dcp_fsspec", "verify", backend.url, "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["kind"] == "run" and len(report["checkpoints"]) == 4
    assert done.stderr == ""  # no progress bar: stderr is not a terminal


@pytest.mark.parametrize("options", ["{not json", "[1, 2]"])
def test_storage_options_that_are_not_a_json_object_are_a_usage_error(
    capsys: pytest.CaptureFixture[str], options: str
) -> None:
    code, _, err = _cli(capsys, "verify", "memory://x/ckpt", "--storage-options", options)
    assert code == 2 and "--storage-options" in err


def test_an_unknown_scheme_is_a_usage_error_naming_the_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(capsys, "inspect", "nosuchscheme://bucket/ckpt")
    assert code == 2 and "nosuchscheme://bucket/ckpt" in err


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "prune"])
def test_nothing_at_the_url_exits_3_naming_it(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend, command: str
) -> None:
    extra = ["--keep", "1"] if command == "prune" else []
    code, _, err = _cli(capsys, command, memory_backend.url, *extra)
    assert code == 3 and memory_backend.url in err


# -- ls and inspect ------------------------------------------------------------------------------


def test_ls_shows_each_iteration_committed_or_not_and_which_is_latest(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1, 2, 3])
    _uncommit(memory_backend, "iter_000000003")  # as if its save died before the commit record
    memory_backend.fs.pipe_file(
        memory_backend.fs._strip_protocol(memory_backend.sub("latest_checkpoint.txt")), b"iter_000000002\n"
    )
    code, out, _ = _cli(capsys, "ls", memory_backend.url)
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("iter_")}
    assert list(rows) == ["iter_000000001", "iter_000000002", "iter_000000003"]
    assert " * " in rows["iter_000000002"] and "*" not in rows["iter_000000001"]
    assert "no: has no .commit.json" in rows["iter_000000003"] and "yes" in rows["iter_000000001"]
    doc = _json(capsys, "ls", memory_backend.url)
    assert doc["latest"] == 2
    assert [(i["iteration"], i["committed"], i["latest"]) for i in doc["iterations"]] == [
        (1, True, False),
        (2, True, True),
        (3, False, False),
    ]
    assert doc["iterations"][0]["size_bytes"] > 0 and doc["iterations"][0]["keys"] == [
        "model",
        "optim",
        "scheduler",
        "trainer",
    ]


def test_inspect_shows_keys_tensors_dtypes_shapes_and_bytes(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1, 2])
    code, out, _ = _cli(capsys, "inspect", memory_backend.url)  # a save_dirname: its latest
    assert code == 0 and "iter_000000002" in out.splitlines()[0]
    assert "key 'model'" in out and "key 'optim'" in out
    row = next(line for line in out.splitlines() if line.startswith("0.weight "))
    assert row.split() == ["0.weight", "float32", "(12,", "6)", "288", "1"]
    doc = _json(capsys, "inspect", memory_backend.sub("iter_000000001", "model"))  # one checkpoint
    assert doc["kind"] == "checkpoint" and len(doc["keys"]) == 1
    entries = {e["fqn"]: e for e in doc["keys"][0]["entries"]}
    assert entries["2.weight"] == {
        "fqn": "2.weight",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [3, 12],
        "nbytes": 144,
        "chunks": 1,
    }
    assert doc["keys"][0]["tensor_bytes"] == 4 * (12 * 6 + 12 + 3 * 12 + 3)


# -- verify --------------------------------------------------------------------------------------


def test_verify_exits_0_on_a_sound_run_and_1_naming_file_item_and_checksums_on_damage(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    _run(memory_backend, [1])
    code, out, _ = _cli(capsys, "verify", memory_backend.url)
    assert code == 0 and out.startswith("OK ")
    model = memory_backend.sub("iter_000000001", "model")
    before, after = _flip_tensor_byte(memory_backend, "0.weight", model)
    with caplog.at_level("INFO", logger="dcp_fsspec"):
        code, out, _ = _cli(capsys, "verify", memory_backend.url)
    assert code == 1
    problem = next(line for line in out.splitlines() if line.startswith("PROBLEM"))
    assert f"{model}/__0_0.distcp: 0.weight:" in problem
    assert f"{before:#010x}" in problem and f"{after:#010x}" in problem
    assert f"verified {model}" in caplog.text  # one log line per checkpoint read


# -- cp ------------------------------------------------------------------------------------------


def test_cp_copies_a_run_between_stores_leaving_uncommitted_folders_behind(
    capsys: pytest.CaptureFixture[str], local_backend: Backend, s3_backend: Backend
) -> None:
    training = _run(local_backend, [1, 2])
    Path(local_backend.url, "iter_000000003", "model").mkdir(parents=True)  # debris of a dead save
    Path(local_backend.url, "iter_000000003", "model", "__0_0.distcp").write_bytes(b"partial")
    options = json.dumps(s3_backend.storage_options)
    code, out, err = _cli(capsys, "cp", local_backend.url, s3_backend.url, "--dst-storage-options", options)
    assert code == 0, err
    assert "skipped" in out and "iter_000000003" in out
    assert verify(s3_backend.url, s3_backend.storage_options).ok
    restored = Training(seed=9)
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        assert ckpt.load(**restored.keys()) == 2
        assert ckpt.committed_iterations() == [1, 2]
    assert_equal(restored.model.state_dict(), training.model.state_dict())
    assert not s3_backend.fs.exists(s3_backend.fs._strip_protocol(s3_backend.sub("iter_000000003")))


def test_cp_refuses_a_destination_that_is_not_empty_unless_told_to_overwrite(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1])
    source, dest = memory_backend.sub("iter_000000001", "model"), memory_backend.sub("copy")
    assert _cli(capsys, "cp", source, dest)[0] == 0
    code, _, err = _cli(capsys, "cp", source, dest)
    assert code == 2 and dest in err and "--overwrite" in err
    assert _cli(capsys, "cp", source, dest, "--overwrite")[0] == 0
    assert verify(dest).ok


def test_cp_leaves_temporary_files_of_writes_in_progress_behind(
    capsys: pytest.CaptureFixture[str], local_backend: Backend, tmp_path: Path
) -> None:
    _run(local_backend, [1])
    model = Path(local_backend.url, "iter_000000001", "model")
    temporary = Path(temporary_path(str(model / "__0_1.distcp")))
    temporary.write_bytes(b"half a file")
    dest = tmp_path / "copy"
    assert _cli(capsys, "cp", local_backend.url, str(dest))[0] == 0
    copied = {p.name for p in dest.rglob("*") if p.is_file()}
    assert "__0_0.distcp" in copied and temporary.name not in copied


def test_a_copy_that_fails_part_way_leaves_the_destination_uncommitted(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend, tmp_path: Path
) -> None:
    _run(memory_backend, [1])
    dest = tmp_path / "copy"
    (dest / "iter_000000001" / "model" / "__0_0.distcp").mkdir(parents=True)  # a data file cannot land
    code, _, err = _cli(capsys, "cp", memory_backend.url, str(dest), "--overwrite")
    assert code == 4 and str(dest / "iter_000000001" / "model" / "__0_0.distcp") in err
    written = {p.name for p in dest.rglob("*") if p.is_file()}
    assert written and not written & {".metadata", ".commit.json", "latest_checkpoint.txt"}
    assert not [p for p in dest.rglob("*") if names.is_temporary(p.name)]


# -- prune ---------------------------------------------------------------------------------------


def test_prune_keeps_the_newest_n_and_never_the_latest_or_anything_newer(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1, 2, 3, 4, 5])
    # The pointer names 4; 5 is newer (as if being written): neither may go.
    memory_backend.fs.pipe_file(
        memory_backend.fs._strip_protocol(memory_backend.sub("latest_checkpoint.txt")), b"iter_000000004\n"
    )
    _uncommit(memory_backend, "iter_000000002")
    code, out, _ = _cli(capsys, "prune", memory_backend.url, "--keep", "2", "--dry-run")
    assert code == 0 and "would delete iter_000000001" in out and "would delete iter_000000002" in out
    with Checkpointer(memory_backend.url) as ckpt:
        assert ckpt.committed_iterations() == [1, 3, 4, 5]
    doc = _json(capsys, "prune", memory_backend.url, "--keep", "2")
    assert doc["deleted"] == [1, 2] and doc["kept"] == [3, 4, 5]
    with Checkpointer(memory_backend.url) as ckpt:
        assert ckpt.committed_iterations() == [3, 4, 5]
    assert _json(capsys, "prune", memory_backend.url, "--keep", "1")["deleted"] == [3]


def test_prune_keep_below_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1])
    code, _, err = _cli(capsys, "prune", memory_backend.url, "--keep", "0")
    assert code == 2 and "--keep" in err


# -- conversions ---------------------------------------------------------------------------------


def test_to_torch_writes_the_state_dict_of_any_url_as_one_torch_save_file(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend, tmp_path: Path
) -> None:
    training = _run(memory_backend, [1])
    out = tmp_path / "model.pt"
    code, _, err = _cli(capsys, "to-torch", memory_backend.sub("iter_000000001", "model"), str(out))
    assert code == 0, err
    assert_equal(torch.load(out, weights_only=True), training.model.state_dict())
    code, _, err = _cli(capsys, "to-torch", memory_backend.sub("iter_000000001", "model"), str(out))
    assert code == 2 and str(out) in err
    # A whole iteration: one entry per key.
    code, _, err = _cli(capsys, "to-torch", memory_backend.url, str(out), "--overwrite")
    everything = torch.load(out, weights_only=False)
    assert code == 0 and sorted(everything) == ["model", "optim", "scheduler", "trainer"]
    assert everything["trainer"]["step"] == 1


def test_to_safetensors_flattens_tensors_and_keeps_plain_values_as_metadata(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend, tmp_path: Path
) -> None:
    from safetensors import safe_open

    training = _run(memory_backend, [1])
    out = tmp_path / "run.safetensors"
    doc = _json(capsys, "to-safetensors", memory_backend.url, str(out))
    assert doc["left_out"] == [] and doc["tensors"] > 4
    with safe_open(str(out), "pt") as f:
        for name, tensor in training.model.state_dict().items():
            assert torch.equal(f.get_tensor(f"model.{name}"), tensor)
        assert json.loads(f.metadata()["trainer.step"]) == 1
        assert json.loads(f.metadata()["trainer.note"]) == "seed 0"


def test_to_safetensors_without_the_package_exits_5_naming_it(
    capsys: pytest.CaptureFixture[str],
    memory_backend: Backend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _run(memory_backend, [1])
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    code, _, err = _cli(capsys, "to-safetensors", memory_backend.url, str(tmp_path / "x.safetensors"))
    assert code == 5 and "pip install safetensors" in err and str(tmp_path / "x.safetensors") in err


# -- progress ------------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_on_a_terminal_only() -> None:
    for stream, drawn in ((io.StringIO(), False), (_Terminal(), True)):
        with Progress("copying", 4096, stream=stream) as progress:
            progress.advance(1024)
            progress.advance(3072)
        text = stream.getvalue()
        assert bool(text) is drawn
        if drawn:
            assert text.startswith("\rcopying [") and "100%" in text and text.endswith("\n")


def test_ls_says_an_uncommitted_folder_older_than_the_pointer_may_be_a_deletion_retention_began(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1, 2, 3])
    _uncommit(memory_backend, "iter_000000001")  # retention removes the record first, then the files
    _uncommit(memory_backend, "iter_000000003")  # not yet published: its save never finished
    memory_backend.fs.pipe_file(
        memory_backend.fs._strip_protocol(memory_backend.sub("latest_checkpoint.txt")), b"iter_000000002\n"
    )
    code, out, _ = _cli(capsys, "ls", memory_backend.url)
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("iter_")}
    assert (
        code == 0
        and "interrupted" in rows["iter_000000001"]
        and "retention deletes it" in rows["iter_000000001"]
    )
    assert "never finished" in rows["iter_000000003"] and "interrupted" not in rows["iter_000000003"]
