"""What the Makefile's light targets install: ``make docs`` no torch, ``make demo`` nothing where
a virtualenv already runs the demo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="needs GNU make: apt-get install make")


def _make(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MAKE), "--no-print-directory", "-f", str(ROOT / "Makefile"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def test_make_docs_installs_the_docs_extra_without_torch_or_the_packages_dependencies() -> None:
    """``make -n -B docs`` prints every command the target would run, from a new venv on."""
    done = _make("-n", "-B", "docs", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    installs = [line for line in done.stdout.splitlines() if "pip install" in line]
    assert installs, done.stdout
    for line in installs:
        assert "torch" not in line and "-e ." not in line and ".[" not in line, (
            f"make docs installs too much: {line}"
        )
    listed = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "extra_requirements.py"), "docs"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    docs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    assert listed == docs and not any(name.startswith("torch") for name in listed)


def test_the_docs_site_reads_the_sources_without_importing_them() -> None:
    """mkdocstrings would import a module it cannot parse; the docs venv has no torch to import."""
    assert "allow_inspection: false" in (ROOT / "mkdocs.yml").read_text()


@pytest.mark.slow
def test_make_demo_runs_in_the_active_virtualenv_where_it_holds_what_the_demo_needs(tmp_path: Path) -> None:
    """This suite's venv holds the package's dependencies and moto: no .venv-demo is made."""
    env = {
        **os.environ,
        "VIRTUAL_ENV": sys.prefix,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    args = f"DEMO_ARGS=--url {tmp_path / 'ckpt'} --steps 60 --every 20 --stop-at 50 --keep-last-n 2"
    done = _make("demo", f"VENV={tmp_path / 'no-venv'}", args, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"make demo: in {sys.prefix}/bin/python" in done.stdout and "bit-identical" in done.stdout
    assert not (tmp_path / ".venv-demo").exists()
