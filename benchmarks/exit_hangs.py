"""How often a DDP script that saves just before it ends fails to exit: the README's example.

``python -m benchmarks.exit_hangs --runs N`` writes the README's ``train_ddp.py`` into a
scratch folder and runs it under ``torchrun --standalone --nproc-per-node 2`` N times, each time
in a fresh folder (a run, not the resume). A run still alive after ``--limit-s`` seconds counts
as hung; it and its workers are then killed. With ``--other-tree PATH`` the runs alternate between
this checkout and PATH (another commit's checkout, put first on ``PYTHONPATH``), so both see
the same load. Each run prints one JSON line; the last line holds the counts per tree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.process_tree import signal_tree

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = re.compile(r'^```python title="train_ddp.py"\n(?P<code>.*?)^```$', re.S | re.M)


def one_run(tree: Path, script: Path, limit_s: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="exit-hangs-") as scratch:
        return _run_in(Path(scratch), tree, script, limit_s)


def _run_in(folder: Path, tree: Path, script: Path, limit_s: float) -> dict[str, object]:
    (folder / script.name).write_text(script.read_text())
    env = {**os.environ, "PYTHONPATH": str(tree)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    start = time.perf_counter()
    with subprocess.Popen(
        [*torchrun, script.name], cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) as process:
        try:
            rc: int | None = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            rc = None
            # torchrun starts each worker in a session of its own: they are found through /proc.
            signal_tree(process.pid, signal.SIGKILL)
    return {"tree": str(tree), "hung": rc is None, "rc": rc, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs per tree")
    p.add_argument("--limit-s", type=float, default=60.0, help="a run alive after this long is hung")
    p.add_argument("--other-tree", type=Path, help="another checkout, run alternately with this one")
    args = p.parse_args()
    match = SCRIPT.search((ROOT / "README.md").read_text())
    if match is None:
        raise SystemExit('README.md has no ```python title="train_ddp.py" block')
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "train_ddp.py"
        script.write_text(match["code"])
        trees = [ROOT, *([args.other_tree.resolve()] if args.other_tree else [])]
        hung = {str(tree): 0 for tree in trees}
        for _ in range(args.runs):
            for tree in trees:
                result = one_run(tree, script, args.limit_s)
                hung[str(tree)] += bool(result["hung"])
                print(json.dumps(result), flush=True)
    print(json.dumps({"runs_per_tree": args.runs, "hung": hung, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
