"""Incremental checkpoints: what a second save writes, and what hashing costs when nothing repeats.

``python -m benchmarks.incremental`` measures, on local disk and on S3 (moto in this process by
default; ``--server seaweedfs|ceph`` for the gateways in tests/servers/):

* ``lora``: a frozen base (``--base-mib``) and trainable adapters (``--adapter-mib``) with two
  AdamW moments each, saved twice by a :class:`~dcp_fsspec.Checkpointer`, the adapters and
  moments changed in between. The second save's bytes written and wall time, with
  ``incremental=True`` and with ``incremental=False``.
* ``all-change``: a state of ``--base-mib`` where every tensor changes between saves; the
  second save's wall and CPU time with and without ``incremental``: the cost of hashing.
* ``hash``: xxh3-128 over 1 GiB in one thread, in GB/s.

Each measurement prints one JSON line; a markdown table closes the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.run import add_server_arguments, git_revision, start_server
from benchmarks.s3server import delta, fetch_counters, totals

MiB = 1024 * 1024
_TENSOR_MIB = 64  # the base in tensors of this size (a transformer's weight matrices)


def lora_state(base_mib: int, adapter_mib: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """A frozen base, adapters, and AdamW's two moments for each adapter."""
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    for i in range(max(1, base_mib // _TENSOR_MIB)):
        model[f"base.{i}.weight"] = torch.randn(min(base_mib, _TENSOR_MIB) * MiB // 4, generator=gen)
    adapter_elements = adapter_mib * MiB // 4 // 8
    for i in range(8):
        model[f"adapter.{i}.weight"] = torch.randn(adapter_elements, generator=gen)
    optim = {
        f"{name}.{moment}": torch.zeros_like(t)
        for name, t in model.items()
        if "adapter" in name
        for moment in ("exp_avg", "exp_avg_sq")
    }
    return {"model": model, "optim": optim}


def train(state: dict[str, dict[str, torch.Tensor]], *, everything: bool) -> None:
    """One step's change: the adapters and their moments, or every tensor."""
    for part in state.values():
        for name, t in part.items():
            if everything or "adapter" in name:
                t.add_(1.0)


class Place:
    """Where a run saves, and how its written bytes are counted."""

    def __init__(self, name: str, url: str, options: dict[str, Any], written: Callable[[], int]) -> None:
        self.name, self.url, self.options, self.written = name, url, options, written


def _save_twice(
    place: Place, state: dict[str, Any], *, incremental: bool, everything: bool
) -> dict[str, Any]:
    from dcp_fsspec import Checkpointer

    with Checkpointer(place.url, place.options, incremental=incremental) as ckpt:
        before = place.written()
        t0 = time.perf_counter()
        ckpt.save(1, **state)
        first_seconds = time.perf_counter() - t0
        first = place.written() - before
        train(state, everything=everything)
        before, c0, t0 = place.written(), time.process_time(), time.perf_counter()
        ckpt.save(2, **state)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        second = place.written() - before
    return {
        "first_bytes": first,
        "first_seconds": round(first_seconds, 3),
        "second_bytes": second,
        "second_seconds": round(seconds, 3),
        "second_cpu_seconds": round(cpu, 3),
    }


def _local_place(parent: str) -> Place:
    root = tempfile.mkdtemp(prefix="incremental-", dir=parent)

    def written() -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)

    return Place("local", os.path.join(root, "run"), {}, written)


def _s3_place(server: Any, n: int) -> Place:
    bucket = f"incremental-{n}"
    server.create_bucket(bucket)
    counters = getattr(server, "counters_url", None)

    def written() -> int:
        if counters is None:  # a gateway: the objects' sizes
            import fsspec

            fs = fsspec.filesystem("s3", **server.storage_options())
            fs.invalidate_cache()
            return sum(int(i["size"]) for i in fs.find(bucket, detail=True).values())
        return int(totals(delta({}, fetch_counters(counters)))["bytes_in"])

    return Place("s3", f"s3://{bucket}/run", server.storage_options(), written)


def _remove(place: Place) -> None:
    """Delete a run's files, so that the next starts from the same disk and server memory."""
    if place.name == "local":
        shutil.rmtree(os.path.dirname(place.url), ignore_errors=True)
        return
    from dcp_fsspec.storage.transport.urls import resolve

    location = resolve(place.url, place.options)
    location.fs.rm(location.path, recursive=True)


def hash_rate() -> float:
    """xxh3-128 over 1 GiB in one thread, GB/s."""
    import xxhash

    data = memoryview(torch.randn(256 * MiB).numpy().tobytes())
    t0 = time.perf_counter()
    xxhash.xxh3_128(data).digest()
    return len(data) / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-mib", type=int, default=1024)
    p.add_argument("--adapter-mib", type=int, default=16)
    p.add_argument("--backends", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    p.add_argument("--repeats", type=int, default=1, help="all-change runs per setting (the fastest is kept)")
    add_server_arguments(p)
    args = p.parse_args()
    samples: list[dict[str, Any]] = []
    notes: list[str] = []
    server = None
    revision = git_revision()

    def emit(sample: dict[str, Any]) -> None:
        sample = {
            "bench": "incremental",
            **sample,
            "base_mib": args.base_mib,
            "adapter_mib": args.adapter_mib,
            "revision": revision,
        }
        print(json.dumps(sample), flush=True)
        samples.append(sample)

    emit({"case": "hash", "gb_per_s": round(hash_rate(), 2)})
    try:
        if "s3" in args.backends:
            server, _ = start_server(args, [args.base_mib], notes)
            for name, value in server.environ().items():
                os.environ.setdefault(name, value)
        n = 0
        for backend in args.backends:
            for case, everything in (("lora", False), ("all-change", True)):
                # Alternating, so that whatever drifts during the run (the page cache, the
                # server's heap) falls on both settings alike.
                for _ in range(1 if case == "lora" else args.repeats):
                    for incremental in (True, False):
                        n += 1
                        place = (
                            _local_place(args.local_dir or tempfile.gettempdir())
                            if backend == "local"
                            else _s3_place(server, n)
                        )
                        state = lora_state(args.base_mib, args.adapter_mib, seed=n)
                        result = _save_twice(place, state, incremental=incremental, everything=everything)
                        emit({"case": case, "backend": backend, "incremental": incremental, **result})
                        _remove(place)
    finally:
        if server is not None:
            server.stop()
    _table(samples)
    for note in notes:
        print(note)


def _table(samples: list[dict[str, Any]]) -> None:
    print(
        "\n| case | backend | incremental | 2nd save bytes | of the 1st | 2nd save s | 2nd save CPU s |\n|---|---|---|---|---|---|---|"
    )
    best: dict[tuple[str, str, bool], dict[str, Any]] = {}
    for s in samples:
        if s["case"] == "hash":
            continue
        key = (s["case"], s["backend"], s["incremental"])
        if key not in best or s["second_seconds"] < best[key]["second_seconds"]:
            best[key] = s
    for (case, backend, incremental), s in best.items():
        share = s["second_bytes"] / s["first_bytes"]
        print(
            f"| {case} | {backend} | {incremental} | {s['second_bytes'] / MiB:.1f} MiB | {share:.1%} | "
            f"{s['second_seconds']} | {s['second_cpu_seconds']} |"
        )


if __name__ == "__main__":
    main()
