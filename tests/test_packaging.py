"""What a new user sees of the package itself: its version, and a missing optional extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

import dcp_fsspec
from dcp_fsspec import cli

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_version_is_printed_by_the_cli_and_exported(capsys: object) -> None:
    done = _run("from dcp_fsspec.cli import main; raise SystemExit(main(['--version']))")
    assert done.returncode == 0
    assert done.stdout.strip() == f"dcp-fsspec {dcp_fsspec.__version__}"
    assert dcp_fsspec.__version__.count(".") >= 2 and "__version__" in dcp_fsspec.__all__


def test_license_is_declared_in_spdx_form_with_its_file() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"] and "Apache License" in (REPO / "LICENSE").read_text()
    assert "moto[server]>=5.0" in project["optional-dependencies"]["demo"]


def _requirements(extra: str | None = None) -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {Requirement(line).name.lower(): Requirement(line) for line in listed}


def test_numpy_is_a_dependency_since_torch_gathers_plans_through_it_at_several_ranks() -> None:
    # torch installs without numpy, yet its gather_object (DCP's plan exchange) needs it.
    numpy = _requirements().get("numpy")
    assert numpy is not None and numpy.marker is None, "numpy must be a dependency on every platform"


def test_torchtitan_extra_states_the_fsspec_its_datasets_accepts() -> None:
    # torchtitan 0.3.0 asks for datasets<4.8, which accepts fsspec<=2026.2.0 only. Unstated, pip
    # backtracks through s3fs and datasets into other torch builds.
    titan = _requirements("torchtitan")
    assert titan["datasets"].specifier == Requirement("datasets>=4.7,<4.8").specifier
    for name in ("fsspec", "s3fs"):
        assert "2026.2.0" in titan[name].specifier and "2026.3.0" not in titan[name].specifier, name


def test_demo_without_moto_says_which_extra_to_install_in_one_line_and_exits_5() -> None:
    done = _run(
        "import sys; sys.modules['moto'] = sys.modules['moto.server'] = None\n"
        "from dcp_fsspec.cli import main; raise SystemExit(main(['demo']))"
    )
    assert done.returncode == 5, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "dcp-fsspec[demo]" in lines[0] and "--url" in lines[0], done.stderr
    assert cli.main is not None
