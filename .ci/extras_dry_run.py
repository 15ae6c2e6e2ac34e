"""CI: every extra of pyproject.toml resolves on top of the torch already installed.

Run with the Python of a venv that holds torch and this package's wheel, given as the argument:
``python .ci/extras_dry_run.py dist/dcp_fsspec-*.whl``. Each extra, and all of them at once, goes
through ``pip install --dry-run --report``.
A constraint pins the installed torch, so a resolution that needs another torch fails at once.
Without it, pip would download a CUDA build of several GB to find that out.
A report that would install torch or a CUDA package fails, and so does a pip error.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import metadata, version
from pathlib import Path

# Another torch, or what only a CUDA build of torch brings in.
_TORCH_NAMES = ("torch", "triton")
_CUDA_PREFIXES = ("nvidia-", "cuda-")


def _dry_run(wheel: Path, extras: str, constraint: Path, scratch: Path) -> str | None:
    """The failure of ``pip install --dry-run WHEEL[extras]``; None if it resolves."""
    report = scratch / f"{extras.replace(',', '+')}.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            "--constraint",
            str(constraint),
            f"{wheel}[{extras}]",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return f"[{extras}] does not resolve on torch {version('torch')}:\n{done.stderr[-3000:]}"
    names = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]
    torch_parts = [name for name in names if name in _TORCH_NAMES or name.startswith(_CUDA_PREFIXES)]
    if torch_parts:
        return f"[{extras}] would install {', '.join(torch_parts)} over torch {version('torch')}"
    return None


def main(wheel: Path) -> int:
    """Dry-run every extra the installed package declares, and all at once; the exit status."""
    extras = sorted(metadata("dcp-fsspec").get_all("Provides-Extra") or [])
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        constraint = scratch / "keep-torch.txt"
        constraint.write_text(f"torch=={version('torch')}\n")
        # pip waits on the network more than it computes: four at a time on two cores.
        with ThreadPoolExecutor(max_workers=4) as pool:
            runs = [*extras, ",".join(extras)]
            failures = [f for f in pool.map(lambda e: _dry_run(wheel, e, constraint, scratch), runs) if f]
    for failure in failures:
        print(failure, file=sys.stderr)
    if failures:
        return 1
    print(f"extras: each of the {len(extras)} and all at once resolve on torch {version('torch')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve()))
