"""An integration whose framework is not installed: one line, of our error tree, naming the extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("module", "framework", "extra"),
    [
        ("lightning", "lightning", "lightning"),
        ("hf", "transformers", "hf"),
        ("ray", "ray", "ray"),
        ("torchtitan", "torchtitan", "torchtitan"),
        ("torch_checkpointing", "torch_checkpointing", "torch-checkpointing"),
    ],
)
def test_importing_an_integration_without_its_framework_names_the_extra_in_one_line(
    module: str, framework: str, extra: str
) -> None:
    code = (
        f"import sys; sys.modules[{framework!r}] = None\n"  # as if not installed
        "from dcp_fsspec.errors import MissingDriverError\n"
        "try:\n"
        f"    import dcp_fsspec.integrations.{module}\n"
        "except MissingDriverError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'dcp-fsspec[{extra}]'" in lines[0], done.stdout + done.stderr
    assert f"dcp_fsspec.integrations.{module}" in lines[0]
