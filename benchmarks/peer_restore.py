"""Peer replicas of the local tier: what they cost a save, and what they save a restore after a lost node.

``python -m benchmarks.peer_restore`` starts moto on 127.0.0.1 behind a counting proxy (the
bytes it serves are what the durable tier's egress would be) and runs 4 ranks (gloo, CPU) as
2 simulated nodes x 2, each node a local folder of its own, on one sharded tensor of
``--size-mib`` in all. Phases, each a fresh set of processes printing one JSON line:

* ``save-plain`` — ``LocalTier(replicas=1)``: the time ``save()`` blocks (the slowest rank).
* ``save-replicas`` — ``LocalTier(replicas=2)``: the same, and the replica bytes sent.
* ``restore-local`` — every node intact: ``load`` from each rank's own copy.
* ``restore-peers`` — node 1's folder wiped (a replacement node): ``load`` from peers.
* ``restore-durable`` — both nodes' folders wiped: ``load`` from moto.

Each restore is checked bit for bit (untimed). The page cache is warm for the local reads.
A last JSON line holds the summary and the ratios, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from benchmarks.run import git_revision

WORLD, PER_NODE, COLS = 4, 2, 1024


def _shard(rank: int, rows: int) -> Any:
    import torch

    start = rank * rows
    return torch.arange(start * COLS, (start + rows) * COLS, dtype=torch.float32).reshape(rows, COLS)


def _rank(rank: int, args: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dcp_fsspec import Checkpointer, LocalTier

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"file://{args['store']}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = args["rows"]
    tier = LocalTier(f"{args['base']}/node-{rank // PER_NODE}", replicas=args["replicas"])
    sample: dict[str, Any] = {}
    tiers: list[str | None] = []
    with Checkpointer(
        args["url"],
        args["options"],
        local_tier=tier,
        on_event=lambda e: tiers.append(e.tier) if e.kind == "load_end" else None,
    ) as ckpt:
        if args["phase"].startswith("save"):
            state = {"w": DTensor.from_local(_shard(rank, rows), mesh, [Shard(0)])}
            dist.barrier()
            start = time.perf_counter()
            ckpt.save(1, model=state)
            sample["save_blocks_s"] = time.perf_counter() - start
            ckpt.wait()
            sample["until_replicated_and_drained_s"] = time.perf_counter() - start
        else:
            target = {"w": DTensor.from_local(torch.zeros(rows, COLS), mesh, [Shard(0)])}
            dist.barrier()
            start = time.perf_counter()
            ckpt.load(model=target)
            sample["load_s"] = time.perf_counter() - start
            sample["tier"] = tiers[-1] if tiers else None
            sample["exact"] = bool(torch.equal(target["w"].to_local(), _shard(rank, rows)))
    Path(f"{args['out']}.{rank}").write_text(json.dumps(sample))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _phase(name: str, replicas: int, common: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    args = {**common, "phase": name, "replicas": replicas, "out": str(tmp / name)}
    args["store"] = str(tmp / f"store-{name}")
    mp.start_processes(_rank, args=(args,), nprocs=WORLD, join=True, start_method="spawn")
    return [json.loads(Path(f"{args['out']}.{r}").read_text()) for r in range(WORLD)]


def _replica_bytes(base: Path) -> int:
    return sum(p.stat().st_size for p in base.glob("node-*/rank*/replicas/**/*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256, help="the whole state, over 4 ranks")
    a = p.parse_args()
    from dcp_fsspec.local_s3 import LocalS3Server
    from tests.servers.counting import CountingProxy

    rows = a.size_mib * 1024 * 1024 // 4 // COLS // WORLD
    results: dict[str, Any] = {"size_mib": a.size_mib, "ranks": WORLD, "nodes": WORLD // PER_NODE}
    with LocalS3Server() as s3, tempfile.TemporaryDirectory() as scratch:
        s3.create_bucket("bench")
        os.environ.update(s3.environ())
        proxy = CountingProxy(s3.endpoint_url).start()
        try:
            options = s3.storage_options()
            options["client_kwargs"] = {
                **options.get("client_kwargs", {}),
                "endpoint_url": proxy.endpoint_url,
            }
            tmp = Path(scratch)
            for name, replicas, folder in (
                ("save-plain", 1, "plain"),
                ("save-replicas", 2, "peers"),
                ("restore-local", 2, "peers"),
                ("restore-peers", 2, "peers"),
                ("restore-durable", 2, "peers"),
            ):
                base = tmp / folder
                if name == "restore-peers":
                    shutil.rmtree(base / "node-1")
                if name == "restore-durable":
                    shutil.rmtree(base / "node-0")
                    shutil.rmtree(base / "node-1")
                common = {"url": f"s3://bench/{folder}", "options": options, "base": str(base), "rows": rows}
                proxy.reset()
                samples = _phase(name, replicas, common, tmp)
                line: dict[str, Any] = {"phase": name, "durable_bytes_served": proxy.sent, "samples": samples}
                if name.startswith("save"):
                    line["save_blocks_s"] = max(s["save_blocks_s"] for s in samples)
                    line["until_replicated_and_drained_s"] = max(
                        s["until_replicated_and_drained_s"] for s in samples
                    )
                    if replicas > 1:
                        line["replica_bytes_per_save"] = _replica_bytes(base)
                else:
                    assert all(s["exact"] for s in samples), samples
                    line["load_s"] = max(s["load_s"] for s in samples)
                    line["tiers"] = [s["tier"] for s in samples]
                print(json.dumps(line), flush=True)
                results[name] = line
        finally:
            proxy.stop()
    summary = {
        "kind": "summary",
        "commit": git_revision(),
        "size_mib": a.size_mib,
        "save_blocks_s": {k: results[k]["save_blocks_s"] for k in ("save-plain", "save-replicas")},
        "save_blocks_ratio": results["save-replicas"]["save_blocks_s"]
        / results["save-plain"]["save_blocks_s"],
        "replica_bytes_per_save": results["save-replicas"]["replica_bytes_per_save"],
        "load_s": {k: results[k]["load_s"] for k in ("restore-local", "restore-peers", "restore-durable")},
        "durable_bytes_served": {
            k: results[k]["durable_bytes_served"]
            for k in ("restore-local", "restore-peers", "restore-durable")
        },
        "peers_speedup_over_durable": results["restore-durable"]["load_s"]
        / results["restore-peers"]["load_s"],
    }
    print(json.dumps(summary), flush=True)
    print("| phase | seconds | durable bytes served |\n|---|---|---|")
    for k in ("save-plain", "save-replicas"):
        print(
            f"| {k}: save() blocks | {results[k]['save_blocks_s']:.2f} | {results[k]['durable_bytes_served']} |"
        )
    for k in ("restore-local", "restore-peers", "restore-durable"):
        print(f"| {k}: load() | {results[k]['load_s']:.2f} | {results[k]['durable_bytes_served']} |")


if __name__ == "__main__":
    main()
