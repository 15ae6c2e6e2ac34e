"""Start-up: every command but the conversions (and ``demo``) runs without importing torch
(seconds): ``--help``, ``ls``, ``prune``, ``cp``, ``inspect`` and ``verify``; and every command's
usage errors are found before it. The package's public names are imported on first use.

Each case runs in a fresh interpreter, as the console script does, and reports whether torch
got imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dcp_fsspec
from dcp_fsspec import cli
from tests.conftest import Backend
from tests.test_verify import _run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

REPO = Path(__file__).resolve().parents[1]

# Runs cli.main(argv) and writes {"code", "torch"} to the file named last.
_PROBE = """
import json, sys
from dcp_fsspec.cli import main
argv, report = json.loads(sys.argv[1]), sys.argv[2]
try:
    code = main(argv)
except SystemExit as e:
    code = e.code
with open(report, "w") as f:
    json.dump({"code": code, "torch": "torch" in sys.modules}, f)
"""


def _command(tmp_path: Path, *argv: str) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(list(argv)), str(report)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert report.exists(), done.stderr
    result: dict[str, object] = json.loads(report.read_text())
    result["out"] = done.stdout
    return result


def test_help_does_not_import_torch(tmp_path: Path) -> None:
    result = _command(tmp_path, "--help")
    assert result["code"] == 0 and "to-safetensors" in str(result["out"])
    assert result["torch"] is False


def test_importing_the_package_does_not_import_torch(tmp_path: Path) -> None:
    code = "import sys, dcp_fsspec; print('torch' in sys.modules, dcp_fsspec.__version__)"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["False", dcp_fsspec.__version__]


def test_ls_does_not_import_torch(tmp_path: Path) -> None:
    backend = Backend("local", str(tmp_path / "run"))
    _run(backend, [1])
    result = _command(tmp_path, "ls", backend.url)
    assert result["code"] == 0 and "iter_000000001" in str(result["out"])
    assert result["torch"] is False


def test_prune_and_cp_do_not_import_torch(tmp_path: Path) -> None:
    backend = Backend("local", str(tmp_path / "run"))
    _run(backend, [1, 2])
    pruned = _command(tmp_path, "prune", backend.url, "--keep", "1")
    copied = _command(tmp_path, "cp", backend.url, str(tmp_path / "copy"))
    assert pruned["code"] == 0 and copied["code"] == 0
    assert (pruned["torch"], copied["torch"]) == (False, False)


def test_inspect_and_verify_do_not_import_torch(tmp_path: Path) -> None:
    backend = Backend("local", str(tmp_path / "run"))
    _run(backend, [1, 2])
    inspected = _command(tmp_path, "inspect", backend.url)
    verified = _command(tmp_path, "verify", backend.url)
    assert inspected["code"] == 0 and "0.weight" in str(inspected["out"])
    assert verified["code"] == 0 and str(verified["out"]).splitlines()[-1].startswith(f"OK {backend.url}")
    assert (inspected["torch"], verified["torch"]) == (False, False)


@pytest.mark.parametrize("command", sorted(cli._COMMANDS))
def test_a_bad_storage_options_json_is_a_usage_error_before_torch_is_imported(
    tmp_path: Path, command: str
) -> None:
    if command == "demo":
        argv = [command, "--url", str(tmp_path / "run")]
    else:
        argv = [
            command,
            str(tmp_path / "run"),
            *([str(tmp_path / "out")] if command in ("cp", "to-torch", "to-safetensors") else []),
        ]
    argv += ["--keep", "1"] if command == "prune" else []
    result = _command(tmp_path, *argv, "--storage-options", "{key: 1}")
    assert result["code"] == 2
    assert result["torch"] is False


@pytest.mark.parametrize("command", sorted(cli._COMMANDS))
def test_every_commands_help_does_not_import_torch(tmp_path: Path, command: str) -> None:
    result = _command(tmp_path, command, "--help")
    assert result["code"] == 0 and f"dcp-fsspec {command}" in str(result["out"])
    assert result["torch"] is False


# -- the lazy package ----------------------------------------------------------------------------


def test_every_public_name_imports_from_the_package_and_all_is_sorted() -> None:
    assert dcp_fsspec.__all__ == sorted(dcp_fsspec.__all__)
    assert set(dcp_fsspec.__all__) <= set(dir(dcp_fsspec))
    for name in dcp_fsspec.__all__:
        value = getattr(dcp_fsspec, name)
        assert value is not None
        if name != "__version__":
            assert value.__module__.startswith("dcp_fsspec."), name
    namespace: dict[str, object] = {}
    exec("from dcp_fsspec import Checkpointer, RetryPolicy, verify, cli", namespace)
    assert namespace["cli"] is cli and namespace["verify"] is dcp_fsspec.verify


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="NoSuchName"):
        dcp_fsspec.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


def test_neither_the_package_nor_the_cli_imports_a_training_framework() -> None:
    """The integrations' frameworks (seconds each to import, optional) load only with them."""
    code = (
        "import sys, contextlib, io, dcp_fsspec\n"
        "dcp_fsspec.Checkpointer, dcp_fsspec.FsspecStorageWriter\n"
        "from dcp_fsspec.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main(['--help'])\n"
        "frameworks = ('lightning', 'pytorch_lightning', 'transformers', 'accelerate', 'torchtitan', 'ray')\n"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] in frameworks))"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"
