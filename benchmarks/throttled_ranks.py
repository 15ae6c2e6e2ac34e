"""Many ranks saving and resuming through a store that throttles, adaptive limits on and off.

``python -m benchmarks.throttled_ranks`` starts moto on 127.0.0.1 behind
``tests/servers/throttling.py``'s proxy: one token bucket for the whole bucket (a new S3
bucket's one prefix), ``--rate`` requests a second, answering ``503 SlowDown`` past it. Then,
for each mode, two fresh gloo jobs of ``--ranks`` processes:

1. **saves**: each rank saves ``--saves`` iterations of its own small state (``--mib-per-rank``
   over ``--keys`` keys, one file per rank and key), so demand is in requests, not bytes.
2. **resume**: fresh processes load every saved iteration and compare it bit for bit.

Modes: ``unthrottled`` (no limit: the floor of what the machine does), ``adaptive``
(``RetryPolicy(adaptive=True)``) and ``fixed`` (``adaptive=False``). Each phase prints one JSON
line: errors, iterations loaded bit-exact, requests admitted and refused, the wall time (the
slowest rank, barrier to barrier), and that time over the busiest prefix's admitted requests
÷ the rate. A markdown table closes the run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.run import git_revision
from dcp_fsspec import Checkpointer, RetryPolicy
from dcp_fsspec.local_s3 import LocalS3Server
from tests.servers.throttling import ThrottlingProxy

MODES = ("unthrottled", "adaptive", "fixed")


def _state(rank: int, it: int, args: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Rank ``rank``'s keys at iteration ``it``: tensors of its own names, values from a seed."""
    keys, tensors = args["keys"], args["tensors"]
    numel = args["mib_per_rank"] * 2**20 // 4 // (keys * tensors)
    generator = torch.Generator().manual_seed(rank * 1_000_003 + it)
    return {
        f"k{k}": {f"r{rank}.t{i}": torch.randn(numel, generator=generator) for i in range(tensors)}
        for k in range(keys)
    }


def _checkpointer(args: dict[str, Any]) -> Checkpointer:
    return Checkpointer(args["url"], args["options"], retry=RetryPolicy(adaptive=args["adaptive"]))


def _saves(rank: int, args: dict[str, Any]) -> int:
    with _checkpointer(args) as ckpt:
        for it in range(1, args["saves"] + 1):
            ckpt.save(it, **_state(rank, it, args))
    return 0


def _resume(rank: int, args: dict[str, Any]) -> int:
    """Every saved iteration loaded; how many came back bit for bit."""
    exact = 0
    with _checkpointer(args) as ckpt:
        for it in range(1, args["saves"] + 1):
            expected = _state(rank, it, args)
            target = {k: {name: torch.empty_like(t) for name, t in d.items()} for k, d in expected.items()}
            ckpt.load(iteration=it, **target)
            exact += all(
                torch.equal(target[k][name], t) for k, d in expected.items() for name, t in d.items()
            )
    return exact


def _rank(rank: int, world: int, store: str, phase: str, args: dict[str, Any]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dist.barrier()
    start = time.perf_counter()
    error = None
    exact = 0
    try:
        exact = (_saves if phase == "saves" else _resume)(rank, args)
    except Exception:  # noqa: BLE001 - counted and reported, not raised
        error = traceback.format_exc(limit=3)
    seconds = time.perf_counter() - start
    limit = _limit_now(args)
    Path(args["out"], f"{phase}-{rank}.json").write_text(
        json.dumps({"seconds": seconds, "error": error, "exact": exact, **limit})
    )
    dist.barrier()
    dist.destroy_process_group()


def _limit_now(args: dict[str, Any]) -> dict[str, int]:
    """This process's limit on requests in flight to the store, and how often it halved."""
    import fsspec

    from dcp_fsspec.storage.transport.concurrency import store_limit

    fs, _ = fsspec.url_to_fs(args["url"], **args["options"])
    limit = store_limit(fs)
    return {"limit": limit.limit, "halvings": limit.epoch}


def _phase(phase: str, world: int, proxy: ThrottlingProxy, args: dict[str, Any]) -> dict[str, Any]:
    """One gloo job; what its ranks report, and what the proxy saw."""
    proxy.reset()
    with tempfile.TemporaryDirectory() as tmp:
        args = {**args, "out": tmp}
        store = str(Path(tmp) / "pg-store")
        mp.start_processes(
            _rank, args=(world, store, phase, args), nprocs=world, join=True, start_method="spawn"
        )
        ranks = [json.loads(Path(tmp, f"{phase}-{r}.json").read_text()) for r in range(world)]
    errors = [r["error"] for r in ranks if r["error"]]
    busiest = max(proxy.admitted_by_prefix.values(), default=0)  # the bucket, rated as one
    seconds = max(r["seconds"] for r in ranks)
    rate = args["rate"]
    return {
        "phase": phase,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "loads_bit_exact": sum(r["exact"] for r in ranks) if phase == "resume" else None,
        "loads": world * args["saves"] if phase == "resume" else None,
        "admitted": proxy.admitted,
        "refused": proxy.refused,
        "busiest_prefix_admitted": busiest,
        "seconds": round(seconds, 2),
        "ideal_seconds": round(busiest / rate, 2) if rate else None,
        "over_ideal": round(seconds / (busiest / rate), 2) if rate and busiest else None,
        "limits": sorted(r["limit"] for r in ranks),
        "halvings": sorted(r["halvings"] for r in ranks),
    }


def _run_mode(mode: str, server: LocalS3Server, args: dict[str, Any]) -> list[dict[str, Any]]:
    rate = None if mode == "unthrottled" else args["rate"]
    proxy = ThrottlingProxy(server.endpoint_url, rate=rate, burst=args["burst"], per_bucket=True).start()
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.create_bucket(bucket)
        options = server.storage_options()
        options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
        run = {**args, "url": f"s3://{bucket}/run", "options": options, "rate": rate}
        run["adaptive"] = mode != "fixed"
        samples = []
        for phase in ("saves", "resume"):
            sample = {"bench": "throttled_ranks", "mode": mode, "ranks": args["ranks"], "rate": rate}
            sample.update(_phase(phase, args["ranks"], proxy, run))
            sample["revision"] = args["revision"]
            print(json.dumps(sample), flush=True)
            samples.append(sample)
        return samples
    finally:
        proxy.stop()


def _table(samples: list[dict[str, Any]]) -> str:
    head = (
        "| mode | phase | errors | bit-exact loads | admitted | refused | busiest prefix | s |"
        " ideal s | × ideal |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for s in samples:
        loads = "" if s["loads"] is None else f"{s['loads_bit_exact']}/{s['loads']}"
        cells = [s["mode"], s["phase"], s["errors"], loads, s["admitted"], s["refused"]]
        cells += [s["busiest_prefix_admitted"], s["seconds"], s["ideal_seconds"], s["over_ideal"]]
        rows.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join([head, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--rate", type=float, default=20.0, help="requests a second per prefix")
    parser.add_argument("--burst", type=int, default=5, help="requests at once per prefix after a pause")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--mib-per-rank", type=int, default=2)
    parser.add_argument("--keys", type=int, default=8, help="keys per save: a file per rank each")
    parser.add_argument("--tensors", type=int, default=4, help="tensors per key")
    parser.add_argument("--modes", default=",".join(MODES))
    options = parser.parse_args()
    args = {
        "ranks": options.ranks,
        "rate": options.rate,
        "burst": options.burst,
        "saves": options.saves,
        "mib_per_rank": options.mib_per_rank,
        "tensors": options.tensors,
        "keys": options.keys,
        "revision": git_revision(),
    }
    samples = []
    with LocalS3Server() as server:
        for name, value in server.environ().items():
            os.environ[name] = value  # credentials for the spawned ranks
        for mode in options.modes.split(","):
            samples.extend(_run_mode(mode, server, args))
    print(_table(samples))


if __name__ == "__main__":
    main()
