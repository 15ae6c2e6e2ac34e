"""A framework's checkpoint save to S3: its own default path against dcp_fsspec's integration.

Lightning, one ``Trainer.save_checkpoint("s3://…")`` of a model of ``--size-mib`` fp32 weights
(``Linear`` layers of 64 MiB; plain SGD, so no optimizer state), after one training step:

* ``lightning_default``: Lightning's own path, ``TorchCheckpointIO``: ``torch.save`` into memory,
  then one fsspec ``pipe`` (s3fs's parallel multipart upload). It takes no
  ``storage_options``, so the worker gets the endpoint and credentials from ``AWS_*`` variables
  (and our options' timeouts from ``FSSPEC_S3``).
* ``dcp_fsspec_ckptio``: ``Trainer(plugins=[FsspecCheckpointIO(storage_options)])``: the same
  single ``.ckpt`` file, uploaded by our backend (complete-or-absent).
* ``dcp_fsspec_sharded``: ``FsspecModelParallelStrategy(storage_options=…)``: a sharded (DCP)
  checkpoint written by ``FsspecStorageWriter`` (FSDP2 over a 1-rank CPU mesh: one file per
  rank, as on every rank of a real job). Lightning's own ``ModelParallelStrategy``
  has no row: its ``save_checkpoint`` (Lightning 2.6) turns the URL into a ``pathlib.Path`` and
  writes a local folder named ``s3:/…``, so its default sharded path never reaches S3.

Each save runs in a fresh process (``python -m benchmarks.frameworks --worker …``), the
implementations taking turns in an order that rotates between repeats, against moto on
127.0.0.1 (``benchmarks/s3server.py``, in this process, counting requests and bytes). Each
measurement prints one JSON line; the medians follow as a markdown table: GB/s (10^9 weight
bytes per second), client CPU seconds per GB (user+sys, all threads of the worker), peak RSS
above what the worker held before the save, and bytes uploaded ÷ the model's bytes.

::

    python -m benchmarks.frameworks                          # 512 MiB, 3 repeats
    python -m benchmarks.frameworks --size-mib 256 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20
LAYER_MIB = 64
IMPLS = ("lightning_default", "dcp_fsspec_ckptio", "dcp_fsspec_sharded")
BUCKET = "bench"


def _trainer(impl: str, storage_options: dict[str, Any]) -> Any:
    from lightning.pytorch import Trainer

    from dcp_fsspec.integrations.lightning import FsspecCheckpointIO, FsspecModelParallelStrategy

    kwargs: dict[str, Any] = {}
    if impl == "dcp_fsspec_ckptio":
        kwargs["plugins"] = [FsspecCheckpointIO(storage_options)]
    elif impl == "dcp_fsspec_sharded":
        kwargs["strategy"] = FsspecModelParallelStrategy(storage_options=storage_options)
    return Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one step, time one ``save_checkpoint`` to ``spec["url"]``, then delete what it wrote."""
    import s3fs
    import torch
    from lightning.pytorch import LightningModule
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks import procmem
    from benchmarks.s3server import delta, fetch_counters, totals

    width = int((LAYER_MIB * MiB / 4) ** 0.5)  # a square fp32 layer of LAYER_MIB

    class Big(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers = max(1, spec["size_mib"] // LAYER_MIB)
            self.net = torch.nn.Sequential(
                *(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
            )

        def configure_model(self) -> None:
            if spec["impl"] == "dcp_fsspec_sharded":  # the strategy needs a parallelized model
                from torch.distributed.fsdp import fully_shard

                assert self.device_mesh is not None  # the strategy sets it before this hook
                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    model = Big()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trainer = _trainer(spec["impl"], spec["storage_options"])
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(2, width)), batch_size=2))
    fs = s3fs.S3FileSystem(**spec["storage_options"])
    before = fetch_counters(spec["counters_url"])
    procmem.reset_peak()
    rss = procmem.rss_mib()
    cpu, start = time.process_time(), time.perf_counter()
    trainer.save_checkpoint(spec["url"])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = procmem.peak_mib() - rss
    server = totals(delta(before, fetch_counters(spec["counters_url"])))
    stored = fs.du(spec["url"])
    fs.rm(spec["url"], recursive=True)
    return {
        "impl": spec["impl"],
        "repeat": spec["repeat"],
        "nbytes": nbytes,
        "stored_bytes": stored,
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),
        "gbps": round(nbytes / seconds / 1e9, 4),
        "peak_extra_rss_mib": round(peak),
        "requests": server["requests"],
        "bytes_up": server["bytes_in"],
    }


def _run_worker(spec: dict[str, Any], environ: dict[str, str]) -> dict[str, Any]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        **environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
    }
    # Lightning's own path takes no storage_options: fsspec's environment configuration gives
    # its s3fs the same long read timeout as ours (moto completes a large multipart upload
    # slowly on a busy machine, and a client that gives up and retries the completion fails).
    env["FSSPEC_S3"] = json.dumps({"config_kwargs": spec["storage_options"]["config_kwargs"]})
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "benchmarks.frameworks", "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"worker {spec['impl']} (repeat {spec['repeat']}) failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def table(rows: list[dict[str, Any]]) -> str:
    """Medians per implementation, and each one's speed ÷ Lightning's default."""
    medians = {}
    for impl in IMPLS:
        runs = [r for r in rows if r["impl"] == impl]
        if runs:
            seconds = statistics.median(r["seconds"] for r in runs)
            nbytes = runs[0]["nbytes"]
            medians[impl] = {
                "n": len(runs),
                "gbps": nbytes / seconds / 1e9,
                "seconds": seconds,
                "cpu_per_gb": statistics.median(r["cpu_seconds"] for r in runs) / (nbytes / 1e9),
                "rss": statistics.median(r["peak_extra_rss_mib"] for r in runs),
                "requests": statistics.median(r["requests"] for r in runs),
                "up": statistics.median(r["bytes_up"] for r in runs) / nbytes,
            }
    base = medians.get("lightning_default")
    lines = [
        "| Lightning save to S3 | n | GB/s | s | CPU s/GB | extra RSS MiB | requests | uploaded ÷ model | ÷ default |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for impl, m in medians.items():
        ratio = f"{m['gbps'] / base['gbps']:.2f}×" if base else "—"
        lines.append(
            f"| {impl} | {m['n']} | {m['gbps']:.3f} | {m['seconds']:.2f} | {m['cpu_per_gb']:.2f} | {m['rss']:.0f} "
            f"| {m['requests']:.0f} | {m['up']:.3f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--size-mib", type=int, default=512, help=f"model weights, in {LAYER_MIB} MiB layers (default 512)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="saves per implementation (default 3; medians)"
    )
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated: {', '.join(IMPLS)}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    from benchmarks.report import machine
    from benchmarks.s3server import CountingS3Server

    impls = args.impls.split(",")
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"unknown --impls {unknown}; choose from {list(IMPLS)}")
    print(json.dumps({"machine": machine(), "size_mib": args.size_mib, "repeats": args.repeats}), flush=True)
    rows = []
    server = CountingS3Server().start()
    try:
        server.create_bucket(BUCKET)
        for repeat in range(args.repeats):
            turn = repeat % len(impls)
            for impl in impls[turn:] + impls[:turn]:
                suffix = "" if impl == "dcp_fsspec_sharded" else ".ckpt"  # a folder of shards, or one file
                spec = {
                    "impl": impl,
                    "repeat": repeat,
                    "size_mib": args.size_mib,
                    "url": f"s3://{BUCKET}/{impl}-{repeat}{suffix}",
                    "storage_options": server.storage_options(),
                    "counters_url": server.counters_url,
                }
                row = _run_worker(spec, server.environ())
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        server.stop()
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
