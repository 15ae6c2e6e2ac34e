"""Small, frequent checkpoints: the latency of one save and one load, not bandwidth.

``python -m benchmarks.small [--repeats 10] [--server moto|seaweedfs|ceph] [--backends s3,local] [--rtt-ms 10] [--local-dirs A,B]``

A ~3 MiB state in four keys (model, optim, scheduler, trainer), as RL policies, adapters and
small models checkpoint it, saved and loaded again and again in one process:

* ``dcp_fsspec``: ``Checkpointer.save(i, model=…, optim=…, scheduler=…, trainer=…)`` and
  ``Checkpointer.load(…)`` (the pointer, every key);
* ``torch + pointer``: what a torchtitan-style trainer does with torch's own writer: one
  ``dcp.save`` per key with ``FsspecWriter`` into the iteration's folder, then the pointer file
  written; a load reads the pointer and runs one ``dcp.load`` per key with ``FsspecReader``.

The implementations take turns, one save and one load each a round, in an order drawn afresh
each round (a drift of the machine falls on all of them alike, and neither always follows the
other: on local disk a save's first fsync commits what the save before it left unsynced), and
an implementation's background work (our retention's deletion thread) finishes off the clock
before the next one runs, as a training step between two saves lets it. The first round
(connections, imports) is not counted; the table shows the medians of the rest: wall ms, CPU
ms of this process (on moto that includes the server, which
runs in this process), and on moto the requests one save and one load sent (counted at the
server). One JSON line per implementation and backend, then the table and the load average.

``--local-dirs A,B`` puts each implementation's local folder under its own parent: give each a
filesystem of its own (two loop-mounted ext4 images will do), so that what one save leaves
unsynced is never committed to the journal by the other's fsync (on one filesystem the ratio of
one tree moved between 0.63x and 1.5x with the order the two ran in).

``--rtt-ms N`` puts :class:`~.latency.LatencyProxy` between the clients and the S3 server: every
request then costs a network's round trip, as it does across one, and a save's time shows its
round trips one after another rather than the server's CPU per request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp

from benchmarks.latency import LatencyProxy
from benchmarks.run import add_server_arguments, start_server
from benchmarks.s3server import CountingS3Server, delta, fetch_counters, totals

BUCKET = "dcp-fsspec-small"
POINTER = "latest_checkpoint.txt"


def small_state(seed: int = 0) -> dict[str, dict[str, Any]]:
    """~3 MiB in four keys: a small MLP's weights, its Adam state, a scheduler, a trainer."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "emb.weight": (512, 256),
        "fc1.weight": (512, 512),
        "fc1.bias": (512,),
        "fc2.weight": (256, 512),
    }
    model = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    optim = {
        "state": {
            k: {"exp_avg": torch.randn(s, generator=g) * 1e-3, "step": torch.tensor(10.0)}
            for k, s in list(shapes.items())[:2]
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(shapes)}],
    }
    return {
        "model": model,
        "optim": optim,
        "scheduler": {"last_epoch": 10, "base_lrs": [1e-3], "_step_count": 11},
        "trainer": {
            "step": 10,
            "tokens_seen": 10 * 4096,
            "rng": torch.randint(0, 2**31, (624,), generator=g),
        },
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _zeros_like(v)
        if isinstance(v, dict)
        else torch.zeros_like(v)
        if isinstance(v, torch.Tensor)
        else v
        for k, v in state.items()
    }


class Ours:
    label = "dcp_fsspec Checkpointer"

    def __init__(self, url: str, so: dict[str, Any]) -> None:
        from dcp_fsspec import Checkpointer

        self.ckpt = Checkpointer(url, so, keep_last_n=2)

    def save(self, iteration: int, state: dict[str, Any]) -> None:
        self.ckpt.save(iteration, **state)

    def load(self, target: dict[str, Any]) -> int:
        return self.ckpt.load(**target)

    def settle(self) -> None:
        self.ckpt.wait()  # retention's deletion thread


class TorchWithPointer:
    label = "torch FsspecWriter/Reader + pointer"

    def __init__(self, url: str, so: dict[str, Any]) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(url, **so)
        self.url, self.so = url.rstrip("/"), so

    def save(self, iteration: int, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        folder = f"{self.url}/iter_{iteration:09d}"
        for key, value in state.items():
            dcp.save(value, storage_writer=FsspecWriter(f"{folder}/{key}", **self.so))
        self.fs.pipe_file(f"{self.root}/{POINTER}", f"iter_{iteration:09d}".encode())

    def load(self, target: dict[str, Any]) -> int:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        name = self.fs.cat_file(f"{self.root}/{POINTER}").decode()
        for key, value in target.items():
            dcp.load(value, storage_reader=FsspecReader(f"{self.url}/{name}/{key}", **self.so))
        return int(name.split("_")[1])

    def settle(self) -> None:
        pass  # nothing runs in the background


IMPLS: dict[str, Callable[[str, dict[str, Any]], Any]] = {"dcp_fsspec": Ours, "torch": TorchWithPointer}


def measure(impls: dict[str, Any], repeats: int, counters_url: str | None) -> dict[str, dict[str, Any]]:
    """Save and load with each implementation in turn, round after round (the first round warms
    up), and return each one's medians by name.

    Interleaved, not one implementation's repeats and then the next's: a drift of the machine (a
    disk whose flushes slow down for a minute, another process) falls on every implementation
    alike, so the ratio holds where the absolute times do not. In an order drawn afresh each
    round: on local disk the first fsync of a save commits to ext4's journal what the save
    before it left unsynced (torch's pointer file), so whoever comes second in a fixed order
    pays for the other (1-2 ms of a 12 ms save, measured). After each load the
    implementation's background work (our retention's deletion thread) finishes before the next
    one starts, off the clock, as a training step between two saves lets it finish.
    """
    state = small_state()
    samples: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in impls}
    order, rng = list(impls), random.Random(0)
    for i in range(repeats + 1):
        rng.shuffle(order)
        for name in order:
            one = _save_and_load(impls[name], i + 1, state, counters_url)
            if i > 0:
                for what, value in one.items():
                    samples[name][what].append(value)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    return {
        name: {
            **{
                what: statistics.median(s[what])
                for what in ("save_ms", "load_ms", "save_cpu_ms", "load_cpu_ms")
            },
            **{
                what: statistics.median(s[what]) if s[what] else None
                for what in ("save_requests", "load_requests")
            },
            "state_bytes": nbytes,
            "keys": len(state),
            "repeats": repeats,
        }
        for name, s in samples.items()
    }


def _save_and_load(
    impl: Any, iteration: int, state: dict[str, Any], counters_url: str | None
) -> dict[str, float]:
    """One timed save of ``state`` as ``iteration`` and one timed load of it, checked bit-exact."""
    before = fetch_counters(counters_url) if counters_url else None
    c0, t0 = time.process_time(), time.perf_counter()
    impl.save(iteration, state)
    c1, t1 = time.process_time(), time.perf_counter()
    middle = fetch_counters(counters_url) if counters_url else None
    target = _zeros_like(state)
    c2, t2 = time.process_time(), time.perf_counter()
    loaded = impl.load(target)
    c3, t3 = time.process_time(), time.perf_counter()
    after = fetch_counters(counters_url) if counters_url else None
    impl.settle()
    same = all(torch.equal(a, b) for a, b in zip(_tensors(target), _tensors(state), strict=True))
    if loaded != iteration or not same:
        raise AssertionError(f"{impl.label} loaded iteration {loaded} wrongly (saved {iteration})")
    one = {
        "save_ms": (t1 - t0) * 1e3,
        "load_ms": (t3 - t2) * 1e3,
        "save_cpu_ms": (c1 - c0) * 1e3,
        "load_cpu_ms": (c3 - c2) * 1e3,
    }
    if before is not None and middle is not None and after is not None:
        one["save_requests"] = totals(delta(before, middle))["requests"]
        one["load_requests"] = totals(delta(middle, after))["requests"]
    return one


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return []


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | implementation | state | save ms | load ms | CPU ms save / load | requests per save / load |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for r in rows:
        req = "–" if r["save_requests"] is None else f"{r['save_requests']:.0f} / {r['load_requests']:.0f}"
        state = f"{r['state_bytes'] / 2**20:.1f} MiB, {r['keys']} keys"
        cpu = f"{r['save_cpu_ms']:.0f} / {r['load_cpu_ms']:.0f}"
        lines.append(
            f"| {r['backend']} | {r['label']} | {state} | {r['save_ms']:.0f} | {r['load_ms']:.0f} | {cpu} | {req} |"
        )
    by = {(r["backend"], r["impl"]): r for r in rows}
    for backend in dict.fromkeys(r["backend"] for r in rows):
        ours, torch_ = by.get((backend, "dcp_fsspec")), by.get((backend, "torch"))
        if ours and torch_:
            lines.append(
                f"| {backend} | ours ÷ torch | | {ours['save_ms'] / torch_['save_ms']:.2f}× | "
                f"{ours['load_ms'] / torch_['load_ms']:.2f}× | | |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.small", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=10, help="saves and loads measured (after one warm-up)")
    p.add_argument("--backends", default="s3,local")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="a round trip this long added to every S3 request (a proxy in front of the server)",
    )
    p.add_argument(
        "--local-dirs",
        default=None,
        metavar="DIR,DIR",
        help="local disk: one parent folder per implementation, in --impls order, each on a "
        "filesystem of its own (a journal of its own: one's unsynced metadata then never "
        "lands in the other's fsync); default: one temporary folder under --local-dir",
    )
    add_server_arguments(p)
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    names = [n for n in args.impls.split(",") if n]
    parents = args.local_dirs.split(",") if args.local_dirs else [args.local_dir] * len(names)
    if len(parents) != len(names):
        p.error(f"--local-dirs names {len(parents)} folders for {len(names)} implementations")
    server = None
    if "s3" in backends:
        server, _ = start_server(args, [1], [])
    proxy = (
        LatencyProxy(server.endpoint_url, args.rtt_ms).start()
        if server is not None and args.rtt_ms > 0
        else None
    )
    rows = []
    try:
        if server is not None:
            server.create_bucket(BUCKET)
        with contextlib.ExitStack() as stack:
            local = {
                name: stack.enter_context(tempfile.TemporaryDirectory(prefix="dcp-fsspec-small-", dir=parent))
                for name, parent in zip(names, parents)
            }
            for backend in backends:
                impls = {}
                for name in names:
                    if backend == "s3":
                        assert server is not None
                        url, so = f"s3://{BUCKET}/{name}", server.storage_options()
                        if proxy is not None:
                            so = {
                                **so,
                                "client_kwargs": {**so["client_kwargs"], "endpoint_url": proxy.endpoint_url},
                            }
                    else:
                        url, so = f"{local[name]}/{name}", {}
                    impls[name] = IMPLS[name](url, so)
                counters = (
                    server.counters_url if backend == "s3" and isinstance(server, CountingS3Server) else None
                )
                for name, result in measure(impls, args.repeats, counters).items():
                    row = {
                        "kind": "small",
                        "backend": backend,
                        "impl": name,
                        "label": impls[name].label,
                        "server": args.s3_endpoint or args.server if backend == "s3" else None,
                        "rtt_ms": args.rtt_ms if backend == "s3" else None,
                        **result,
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()
    print(render(rows))
    print(f"load average (1, 5, 15 min) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
