"""Where a save's client CPU goes: py-spy samples one benchmark worker, then the top functions.

``python -m benchmarks.profile [--phase save] [--impl dcp_fsspec] [--size-mib 1024] [--server moto]``
``python -m benchmarks.profile --backend local [--local-dir DIR] --phase load`` (a cold load)

Starts the S3 server as ``benchmarks.run`` does (moto in this process by default: its CPU is
not in the profile), or with ``--backend local`` uses a folder under ``--local-dir`` (a
temporary one by default; a load reads it with the page cache dropped, as ``benchmarks.run``'s
cold local loads do), runs one ``benchmarks.worker`` under ``py-spy record`` (``pip install
py-spy``; every thread, 100 samples/s, idle threads left out), and prints the functions that
took the largest share of the samples: by *self* (the sampled frame itself, C code it called
included: ``b"".join``'s copy counts to the line that joins) and by *total* (anywhere on the
stack). The raw samples stay in ``--out`` for flame graphs (``flamegraph.pl`` reads them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.run import BUCKET, REPO, SERVERS, drop_page_cache, start_server

# Stacks that are the worker's own work, not the phase measured: building the state (randn),
# imports at start-up, torch's teardown at exit.
NOT_THE_PHASE = ("benchmarks/state.py", "importlib._bootstrap", "torch/library.py")
# Frames under everything (threads, the event loop, the worker's own main): no total of theirs.
PLUMBING = (
    "(threading.py)",
    "(thread.py)",
    "(<frozen runpy>)",
    "(base_events.py)",
    "(events.py)",
    "worker.py)",
)
# Where a thread that py-spy still reports waits, not works (a pool's worker waiting for work,
# the event loop in epoll, a lock or condition).
IDLE = {
    "EpollSelector.select",
    "Condition.wait",
    "_worker",
    "Event.wait",
    "Thread.join",
    "Queue.get",
    "Thread._wait_for_tstate_lock",
    "_wait_for_tstate_lock",
    "Lock.acquire",
    "sleep",
}


def top_functions(raw: str, n: int) -> tuple[int, int, list[tuple[str, int]], list[tuple[str, int]]]:
    """Samples of the phase (waits in :data:`IDLE` not counted), samples left out
    (:data:`NOT_THE_PHASE`, and C code the worker calls itself), and the ``n`` functions
    with most samples by self and by total, from py-spy's ``--format raw`` (one
    ``frame;frame;…;leaf count`` line per distinct stack)."""
    self_count: Counter[str] = Counter()
    total_count: Counter[str] = Counter()
    samples = left_out = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        if any(marker in stack for marker in NOT_THE_PHASE):
            left_out += int(count)
            continue
        frames = [_function(f) for f in stack.split(";")]
        frames = [f for f in frames if f]
        if not frames or frames[-1].split(" (")[0] in IDLE:
            continue
        if frames[-1].endswith("worker.py)"):  # C code the harness calls itself (gc.collect, randn)
            left_out += int(count)
            continue
        k = int(count)
        samples += k
        self_count[frames[-1]] += k
        for f in set(frames):
            if not f.endswith(PLUMBING):
                total_count[f] += k
    return samples, left_out, self_count.most_common(n), total_count.most_common(n)


def _function(frame: str) -> str:
    """``func (path/to/module.py:123)`` → ``func (module.py)``: one entry per function, not per line."""
    name, _, where = frame.partition(" (")
    if not where:
        return name.strip()
    path = where.rstrip(")").rsplit(":", 1)[0]
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif str(REPO) in path:
        path = os.path.relpath(path, REPO)
    else:
        path = os.path.basename(path)
    return f"{name.strip()} ({path})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.split("\n")[0])
    p.add_argument("--phase", default="save", choices=["save", "load"])
    p.add_argument("--impl", default="dcp_fsspec")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--ranks", type=int, default=1, help="gloo ranks (py-spy follows each one)")
    p.add_argument(
        "--gil",
        action="store_true",
        help="only samples of threads holding the GIL: Python's own CPU, without threads "
        "waiting for the GIL (which py-spy otherwise counts as busy) and without C "
        "code that released it (socket writes, CRCs, fsync)",
    )
    p.add_argument("--server", choices=["moto", *SERVERS], default="moto")
    p.add_argument("--s3-endpoint", default=None)
    p.add_argument("--s3-key", default="testing")
    p.add_argument("--s3-secret", default="testing")
    p.add_argument("--moto-complete", default="lean", help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=["s3", "local"], default="s3")
    p.add_argument("--local-dir", default=None, help="with --backend local: where the checkpoint goes")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "profile"))
    args = p.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.access(py_spy, os.X_OK):
        raise SystemExit("py-spy is not installed: pip install py-spy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.backend == "local":
            base = args.local_dir or stack.enter_context(
                tempfile.TemporaryDirectory(prefix="dcp-fsspec-profile-")
            )
            url, options, env = os.path.join(base, "profile", args.impl), {}, {}
            where = f"local {base}"
        else:
            server, _ = start_server(args, [args.size_mib], [])
            stack.callback(server.stop)
            server.create_bucket(BUCKET)
            url, options, env = (
                f"s3://{BUCKET}/profile/{args.impl}",
                server.storage_options(),
                server.environ(),
            )
            where = f"server {args.s3_endpoint or args.server}"
        worker = [
            sys.executable,
            "-m",
            "benchmarks.worker",
            "save",
            "--size-mib",
            str(args.size_mib),
            "--impl",
            args.impl,
            "--backend",
            args.backend,
            "--url",
            url,
            "--storage-options",
            json.dumps(options),
            "--world-size",
            str(args.ranks),
        ]
        env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
        if args.phase == "load":  # the save first, unprofiled
            subprocess.run(worker, cwd=REPO, env=env, check=True, capture_output=True)
            worker[3] = "load"
            if args.backend == "local":
                drop_page_cache(url)
        raw = out / f"{args.impl}-{args.phase}-{args.backend}-{args.size_mib}MiB-{args.ranks}r.txt"
        follow = (["--subprocesses"] if args.ranks > 1 else []) + (["--gil"] if args.gil else [])
        record = [
            py_spy,
            "record",
            *follow,
            "--format",
            "raw",
            "--rate",
            "100",
            "-o",
            str(raw),
            "--",
            *worker,
        ]
        done = subprocess.run(record, cwd=REPO, env=env, capture_output=True, text=True)
        print(*(ln for ln in done.stdout.splitlines() if ln.startswith('{"kind"')), sep="\n")
        if done.returncode != 0:
            raise SystemExit(f"py-spy record failed ({done.returncode}): {done.stderr[-2000:]}")
    samples, left_out, by_self, by_total = top_functions(raw.read_text(), args.top)
    print(
        f"\n{samples} samples (100/s, every thread not idle) of one {args.phase}, waits left out ({args.impl}, {args.size_mib} MiB, "
        f"{where}); {left_out} more left out (state building, imports); raw: {raw}\n"
    )
    for title, rows in (("self", by_self), ("total", by_total)):
        print(f"| function | {title} % |\n|---|---:|")
        print("\n".join(f"| `{f}` | {100 * k / samples:.1f} |" for f, k in rows), "\n")


if __name__ == "__main__":
    main()
