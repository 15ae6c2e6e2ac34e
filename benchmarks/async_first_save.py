"""How long each asynchronous ``save()`` of a run blocks training: the first against the later ones.

``python -m benchmarks.async_first_save`` runs ``--runs`` fresh processes. Each builds a
``--size-mib`` state (``benchmarks/state.py``), then times on local disk, with
``async_mode="async_with_pinned_mem"``:

* ``construct_s``: ``Checkpointer(...)``;
* ``prepare_s``: ``Checkpointer.prepare(model=state)``, with ``--prepare`` (the library must have it);
* a pause of ``--gap-s`` seconds: the training steps between building the Checkpointer and the
  first save;
* ``save_s``: each of ``--saves`` saves, only the call itself. Each save starts after a
  ``wait()`` for the previous one (untimed), so it measures the staging and nothing else.

Each run prints one JSON line; the last line holds the medians per save and a markdown row.
The library measured is the checkout the command runs in: copy this script into another
commit's checkout to time that commit the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import state as st

ASYNC = "async_with_pinned_mem"


def one_run(args: argparse.Namespace) -> dict[str, object]:
    from dcp_fsspec import Checkpointer

    model = st.build(st.realistic(args.size_mib, seed=1))
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        t0 = time.perf_counter()
        ckpt = Checkpointer(f"{folder}/run", async_mode=ASYNC)
        construct = time.perf_counter() - t0
        prepare = None
        if args.prepare:
            t0 = time.perf_counter()
            ckpt.prepare(model=model)
            prepare = time.perf_counter() - t0
        time.sleep(args.gap_s)
        saves = []
        for iteration in range(1, args.saves + 1):
            ckpt.wait()
            t0 = time.perf_counter()
            ckpt.save(iteration, model=model)
            saves.append(time.perf_counter() - t0)
        ckpt.finalize()
    return {"kind": "run", "construct_s": construct, "prepare_s": prepare, "save_s": saves}


def summary(runs: list[dict[str, object]], args: argparse.Namespace) -> dict[str, object]:
    saves = [statistics.median(run["save_s"][i] for run in runs) for i in range(args.saves)]  # type: ignore[index]
    later = statistics.median(saves[1:]) if len(saves) > 1 else float("nan")
    construct = statistics.median(run["construct_s"] for run in runs)  # type: ignore[misc]
    row = " | ".join(f"{s:.3f}" for s in saves)
    return {
        "kind": "summary",
        "size_mib": args.size_mib,
        "gap_s": args.gap_s,
        "prepare": args.prepare,
        "runs": len(runs),
        "construct_s": construct,
        "save_s": saves,
        "first_over_later": saves[0] / later,
        "markdown": f"| {construct:.3f} | {row} | {saves[0] / later:.2f}× |",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.async_first_save", description=__doc__.split("\n")[0]
    )
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--gap-s", type=float, default=10.0, help="seconds between construction and the first save"
    )
    p.add_argument(
        "--prepare", action="store_true", help="call Checkpointer.prepare right after construction"
    )
    p.add_argument("--dir", default=None, help="where the runs save (default: the system's temp folder)")
    p.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_run:
        print(json.dumps(one_run(args)), flush=True)
        return
    runs = []
    child_args = list(argv if argv is not None else sys.argv[1:])
    for _ in range(args.runs):
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.async_first_save", *child_args, "--one-run"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.getcwd(),
        )
        line = done.stdout.strip().splitlines()[-1]
        print(line, flush=True)
        runs.append(json.loads(line))
    print(json.dumps(summary(runs, args)), flush=True)


if __name__ == "__main__":
    main()
