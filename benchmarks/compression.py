"""What zstd compression (``WriterSettings(compression="zstd")``) costs and saves.

For each backend (a local folder, S3 on moto), state and compression level: the bytes stored,
and save and load throughput in GB/s of *state* (uncompressed tensor bytes, so rows compare).
Each save and load runs in a fresh process (``python -m benchmarks.compression --worker …``);
the S3 server (``benchmarks/s3server.py``, ranged reads served from the requested bytes) runs in
this one. Every measurement prints one JSON line; a markdown table follows at the end.

States, all rebuilt from a seed in each worker:

* ``realistic``: ``benchmarks/state.py``'s mix (fp32/bf16/int64, ``randn``): random mantissas,
  the worst case for compression.
* ``randn_fp32``: one kind of tensor, ``randn`` fp32.
* ``trained_bf16``: bf16 weights drawn like trained ones (``N(0, 0.02)``, a few layers with
  larger scale): their exponents take a handful of values, which zstd's entropy coder packs.

::

    python -m benchmarks.compression                       # 256 MiB states, local and S3
    python -m benchmarks.compression --size-mib 64 --levels none,1,3,9
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

MiB = 1 << 20
STATES = ("realistic", "randn_fp32", "trained_bf16")


def build_state(kind: str, size_mib: int, seed: int = 0) -> dict[str, Any]:
    """The state ``kind`` of ``size_mib`` MiB of tensor data, the same in every process."""
    import torch

    from benchmarks import state as bench_state

    if kind == "realistic":
        return bench_state.build(bench_state.realistic(size_mib, seed))
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    item = 4 if kind == "randn_fp32" else 2
    layer_bytes = 16 * MiB
    for i in range(max(1, size_mib * MiB // layer_bytes)):
        rows = layer_bytes // (item * 1024)
        if kind == "randn_fp32":
            out[f"layer{i}.weight"] = torch.randn(rows, 1024, generator=gen)
        else:
            scale = 0.02 if i % 4 else 0.2  # norms and embeddings run larger
            out[f"layer{i}.weight"] = (torch.randn(rows, 1024, generator=gen) * scale).to(torch.bfloat16)
    return out


def _tensor_bytes(state: dict[str, Any]) -> int:
    import torch

    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One save and one load of ``spec``'s state at ``spec["url"]``; what they measured."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_fsspec import FsspecStorageReader, FsspecStorageWriter, WriterSettings
    from dcp_fsspec.storage.transport.urls import resolve

    state = build_state(spec["state"], spec["size_mib"])
    level = spec["level"]
    settings = (
        WriterSettings() if level is None else WriterSettings(compression="zstd", compression_level=level)
    )
    options = spec["storage_options"]
    start = time.perf_counter()
    dcp.save(state, storage_writer=FsspecStorageWriter(spec["url"], options, settings=settings), no_dist=True)
    saved = time.perf_counter() - start
    location = resolve(spec["url"], options)
    stored = sum(
        info["size"]
        for info in location.fs.ls(location.path, detail=True)
        if info["name"].endswith(".distcp")
    )
    target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    start = time.perf_counter()
    dcp.load(target, storage_reader=FsspecStorageReader(spec["url"], options), no_dist=True)
    loaded = time.perf_counter() - start
    exact = all(torch.equal(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    location.fs.rm(location.path, recursive=True)
    nbytes = _tensor_bytes(state)
    return {
        "backend": spec["backend"],
        "state": spec["state"],
        "zstd_level": level,
        "state_bytes": nbytes,
        "stored_bytes": stored,
        "ratio": round(stored / nbytes, 4),
        "save_s": round(saved, 3),
        "load_s": round(loaded, 3),
        "save_gbps": round(nbytes / saved / 1e9, 3),
        "load_gbps": round(nbytes / loaded / 1e9, 3),
        "bit_exact": exact,
    }


def _run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "benchmarks.compression", "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(
            f"worker {spec['backend']}/{spec['state']}/{spec['level']} failed:\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | state | zstd level | stored / state | save GB/s | load GB/s |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        level = "—" if r["zstd_level"] is None else str(r["zstd_level"])
        lines.append(
            f"| {r['backend']} | {r['state']} | {level} | {r['ratio']:.3f} | {r['save_gbps']:.2f} | {r['load_gbps']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="tensor data per state (default 256)")
    parser.add_argument("--backends", default="local,s3", help="comma-separated: local, s3")
    parser.add_argument("--states", default=",".join(STATES), help=f"comma-separated: {', '.join(STATES)}")
    parser.add_argument(
        "--levels", default="none,1,3", help="comma-separated zstd levels; 'none' = uncompressed"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    from benchmarks.s3server import CountingS3Server

    levels = [None if v == "none" else int(v) for v in args.levels.split(",")]
    backends = args.backends.split(",")
    rows = []
    server = CountingS3Server().start() if "s3" in backends else None
    try:
        with tempfile.TemporaryDirectory(prefix="dcp-fsspec-compression-") as local_root:
            if server is not None:
                import s3fs

                s3fs.S3FileSystem(**server.storage_options()).mkdir("bench")
            for backend in backends:
                for kind in args.states.split(","):
                    for level in levels:
                        if backend == "s3":
                            assert server is not None
                            url, options = f"s3://bench/{kind}-{level}", server.storage_options()
                        else:
                            url, options = os.path.join(local_root, f"{kind}-{level}"), {}
                        spec = {
                            "backend": backend,
                            "state": kind,
                            "level": level,
                            "size_mib": args.size_mib,
                            "url": url,
                            "storage_options": options,
                        }
                        row = _run_worker(spec)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    finally:
        if server is not None:
            server.stop()
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
