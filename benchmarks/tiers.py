"""Two tiers against a direct S3 save: what ``save()`` blocks, what a resume costs, how fast the drain uploads.

``python -m benchmarks.tiers`` starts a moto S3 server on 127.0.0.1 (the harness's
``CountingS3Server``, port chosen by the OS; ``--server ceph`` or ``seaweedfs`` starts that
server instead, ``--s3-endpoint`` uses a running one) and, per repeat, runs four fresh
processes on the same 1 GiB state (``benchmarks/state.py``), each printing one JSON line:

* ``direct`` — ``Checkpointer(s3_url).save(1, model=state)`` in synchronous mode: the time
  ``save()`` blocks, which is the whole S3 save (and its upload GB/s).
* ``tiered`` — ``Checkpointer(s3_url, local_tier=LocalTier(folder)).save(1, model=state)``, synchronous:
  the time ``save()`` blocks (the local commit), then ``wait()`` for the drain, whose
  ``drain_end`` event gives the durable copy's upload GB/s. The local files are then flushed and
  dropped from the page cache, so the next read comes from the disk.
* ``resume-local`` — a new Checkpointer with the same ``local_dirname``: ``load`` reads the local tier (cold).
* ``resume-s3`` — a new Checkpointer with an empty ``local_dirname`` (a fresh machine): ``load``
  reads the durable tier.

With ``--async-mode async_with_pinned_mem`` both saves are asynchronous: ``save()`` blocks for
the staging only, and ``finalize()`` waits for the rest. Every load is checked bit for bit
(untimed). At the end one JSON line holds the medians, and a markdown table is printed. The
state is built before each clock starts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import state as st
from benchmarks.run import REPO, add_server_arguments, drop_page_cache, git_revision, start_server

PHASES = ("direct", "tiered", "resume-local", "resume-s3")
GB = 1e9


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One phase in this (fresh) process; returns its sample."""
    from dcp_fsspec import Checkpointer, LocalTier

    options = json.loads(args.storage_options)
    entries = st.realistic(args.size_mib, args.seed)
    nbytes = st.nbytes(entries)
    sample: dict[str, Any] = {"kind": "sample", "phase": args.phase, "repeat": args.repeat, "bytes": nbytes}
    if args.phase in ("direct", "tiered"):
        state = st.build(entries)
        drains: list[Any] = []
        local = args.local if args.phase == "tiered" else None
        ckpt = Checkpointer(
            args.url,
            options,
            local_tier=None if local is None else LocalTier(local),
            async_mode=args.async_mode,
            on_event=lambda e: drains.append(e) if e.kind == "drain_end" else None,
        )
        start = time.perf_counter()
        ckpt.save(1, model=state)
        sample["save_blocks_s"] = time.perf_counter() - start
        start = time.perf_counter()
        ckpt.finalize()  # waits for the drain
        sample["until_durable_s"] = sample["save_blocks_s"] + time.perf_counter() - start
        if args.phase == "direct":
            sample["upload_gbps"] = (
                nbytes / sample["until_durable_s"] / GB
            )  # the whole save in async mode too
        else:
            event = drains[-1]
            sample["drain_s"], sample["drain_bytes"] = event.seconds, event.nbytes
            sample["upload_gbps"] = event.nbytes / event.seconds / GB
            drop_page_cache(args.local)
        return sample
    target = st.template(entries)
    tiers: list[str | None] = []
    ckpt = Checkpointer(
        args.url,
        options,
        local_tier=LocalTier(args.local),
        on_event=lambda e: tiers.append(e.tier) if e.kind == "load_end" else None,
    )
    start = time.perf_counter()
    iteration = ckpt.load(model=target)
    sample["load_s"] = time.perf_counter() - start
    ckpt.finalize()
    sample["tier"], sample["iteration"] = tiers[-1] if tiers else None, iteration
    sample["load_gbps"] = nbytes / sample["load_s"] / GB
    sample["bit_exact"] = not st.verify(entries, target)
    return sample


def _run_phase(
    phase: str, repeat: int, url: str, local: str, options: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "benchmarks.tiers",
        "--worker",
        phase,
        "--repeat",
        str(repeat),
        "--url",
        url,
        "--local",
        local,
        "--storage-options",
        json.dumps(options),
        "--size-mib",
        str(args.size_mib),
        "--seed",
        str(args.seed),
        "--async-mode",
        args.async_mode,
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{phase} (repeat {repeat}) failed: {done.stderr.strip().splitlines()[-1:]}")
    sample: dict[str, Any] = json.loads(lines[-1])
    print(json.dumps(sample), flush=True)
    return sample


def _median(samples: list[dict[str, Any]], phase: str, field: str) -> float:
    return statistics.median(s[field] for s in samples if s["phase"] == phase)


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians the README quotes, and their ratios."""
    m = {
        "direct_save_s": _median(samples, "direct", "save_blocks_s"),
        "tiered_save_s": _median(samples, "tiered", "save_blocks_s"),
        "tiered_until_durable_s": _median(samples, "tiered", "until_durable_s"),
        "resume_local_s": _median(samples, "resume-local", "load_s"),
        "resume_s3_s": _median(samples, "resume-s3", "load_s"),
        "direct_upload_gbps": _median(samples, "direct", "upload_gbps"),
        "drain_upload_gbps": _median(samples, "tiered", "upload_gbps"),
    }
    m["save_ratio"] = m["tiered_save_s"] / m["direct_save_s"]
    m["resume_speedup"] = m["resume_s3_s"] / m["resume_local_s"]
    return m


def table(m: dict[str, Any], size_mib: int, server: str, async_mode: str) -> str:
    mode = "sync" if async_mode == "disabled" else "async"
    return "\n".join(
        [
            f"| {size_mib} MiB state, {server} on 127.0.0.1 (medians) | seconds | |",
            "|---|---|---|",
            f"| `save()` blocks, direct S3 ({mode}) | {m['direct_save_s']:.2f} | {m['direct_upload_gbps']:.3f} GB/s until committed |",
            f"| `save()` blocks, local tier ({mode}) | {m['tiered_save_s']:.2f} | {m['save_ratio']:.2f}x the direct save |",
            f"| ... until the durable copy is committed | {m['tiered_until_durable_s']:.2f} | drain {m['drain_upload_gbps']:.3f} GB/s upload |",
            f"| resume from the local tier (cold page cache) | {m['resume_local_s']:.2f} | {m['resume_speedup']:.1f}x faster than from S3 |",
            f"| resume from S3 (empty local tier) | {m['resume_s3_s']:.2f} | |",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=PHASES, dest="phase", help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--local", help=argparse.SUPPRESS)
    p.add_argument("--storage-options", default="{}", help=argparse.SUPPRESS)
    p.add_argument(
        "--async-mode",
        choices=["disabled", "async_with_pinned_mem"],
        default="disabled",
        help="the saves' async_mode: asynchronous, save() blocks for the staging only",
    )
    add_server_arguments(p)
    args = p.parse_args(argv)
    if args.phase is not None:
        print(json.dumps(_worker(args)), flush=True)
        return
    samples: list[dict[str, Any]] = []
    server, _ = start_server(args, [args.size_mib], [])
    server_name = (
        "S3 at " + args.s3_endpoint
        if args.s3_endpoint
        else {"ceph": "Ceph RGW", "seaweedfs": "SeaweedFS"}.get(args.server, "moto S3")
    )
    try:
        with tempfile.TemporaryDirectory(prefix="dcp-fsspec-tiers-", dir=args.local_dir) as tmp:
            options = server.storage_options()
            server.create_bucket("bench")
            import fsspec

            s3 = fsspec.filesystem("s3", **options)
            for repeat in range(args.repeats):
                direct, tiered = f"s3://bench/direct-{repeat}", f"s3://bench/tiered-{repeat}"
                local, fresh = f"{tmp}/local-{repeat}", f"{tmp}/fresh-{repeat}"
                samples.append(_run_phase("direct", repeat, direct, local, options, args))
                s3.rm(direct, recursive=True)  # moto keeps objects in memory, Ceph on a sparse file
                samples.append(_run_phase("tiered", repeat, tiered, local, options, args))
                samples.append(_run_phase("resume-local", repeat, tiered, local, options, args))
                samples.append(_run_phase("resume-s3", repeat, tiered, fresh, options, args))
                s3.rm(tiered, recursive=True)
                shutil.rmtree(local, ignore_errors=True)
                shutil.rmtree(fresh, ignore_errors=True)
    finally:
        server.stop()
    m = summary(samples)
    for s in samples:
        if "bit_exact" in s and not s["bit_exact"]:
            raise SystemExit(f"{s['phase']} (repeat {s['repeat']}) did not load the state bit for bit")
    print(
        json.dumps(
            {
                "kind": "summary",
                "date": datetime.date.today().isoformat(),
                "commit": git_revision(),
                "repeats": args.repeats,
                "size_mib": args.size_mib,
                "server": server_name,
                "async_mode": args.async_mode,
                **m,
            }
        ),
        flush=True,
    )
    print(table(m, args.size_mib, server_name, args.async_mode))


if __name__ == "__main__":
    main()
