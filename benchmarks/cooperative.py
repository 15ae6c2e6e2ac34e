"""Cooperative restore: a replicated (DDP) state loaded by 1, 2 and 4 ranks from moto.

``python -m benchmarks.cooperative`` starts the harness's counting moto server on 127.0.0.1,
saves one state (``benchmarks/state.py``'s realistic mix, ``--size-mib``) from this process,
then per rank count and reader runs a fresh gloo job in which every rank loads the whole state:

* ``torch-fsspec``: torch's ``FsspecReader``.
* ``ours``: ``FsspecStorageReader`` without cooperation.
* ``ours-cooperative``: ``FsspecStorageReader(cooperative=True)``.

Each run prints one JSON line: the wall time of ``dcp.load`` (the slowest rank, from a barrier
to a barrier), the bytes the server sent for GetObject, its GET requests, and those bytes over
the checkpoint's unique bytes. Every load is checked bit for bit, untimed. A markdown table
closes the run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import state as st
from benchmarks.run import git_revision
from benchmarks.s3server import CountingS3Server, delta, fetch_counters
from dcp_fsspec import ReaderSettings

READERS = ("torch-fsspec", "ours", "ours-cooperative")
BUCKET = "bench"


def _reader(name: str, url: str, options: dict[str, Any]) -> Any:
    if name == "torch-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url, **options)
    from dcp_fsspec import FsspecStorageReader

    return FsspecStorageReader(
        url, storage_options=options, settings=ReaderSettings(cooperative=name == "ours-cooperative")
    )


def _rank(
    rank: int, world: int, store: str, reader: str, url: str, options: dict[str, Any], args: dict[str, Any]
) -> None:
    import torch.distributed.checkpoint as dcp

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    entries = st.realistic(args["size_mib"], args["seed"])
    target = st.template(entries)
    dist.barrier()
    before = fetch_counters(args["counters_url"]) if rank == 0 else {}
    dist.barrier()
    start = time.perf_counter()
    dcp.load(target, storage_reader=_reader(reader, url, options))
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        ops = delta(before, fetch_counters(args["counters_url"]))
        gets = {k: v for k, v in ops.items() if k.startswith("GetObject")}
        read = int(sum(v["bytes_out"] for v in gets.values()))
        sample = {
            "bench": "cooperative",
            "reader": reader,
            "ranks": world,
            "seconds": round(seconds, 3),
            "bytes_read": read,
            "unique_bytes": args["unique"],
            "read_over_unique": round(read / args["unique"], 3),
            "get_requests": int(sum(v["requests"] for v in gets.values())),
            "size_mib": args["size_mib"],
            "revision": args["revision"],
        }
        print(json.dumps(sample), flush=True)
        with open(args["out"], "a") as f:
            f.write(json.dumps(sample) + "\n")
    bad = st.verify(entries, target)
    if bad:
        raise AssertionError(f"rank {rank}: {len(bad)} entries differ, e.g. {bad[:3]}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="tensor data of the state")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--readers", nargs="+", choices=READERS, default=list(READERS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from dcp_fsspec import FsspecStorageWriter

    server = CountingS3Server().start()
    try:
        server.create_bucket(BUCKET)
        options = server.storage_options()
        for name, value in server.environ().items():
            os.environ.setdefault(name, value)
        url = f"s3://{BUCKET}/coop"
        import torch.distributed.checkpoint as dcp

        dcp.save(
            st.build(st.realistic(args.size_mib, args.seed)),
            storage_writer=FsspecStorageWriter(url, options),
            no_dist=True,
        )
        fs = FsspecStorageWriter(url, options).location.fs
        unique = sum(int(e["size"]) for e in fs.ls(f"{BUCKET}/coop", detail=True))
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "samples.jsonl")
            shared = {
                "size_mib": args.size_mib,
                "seed": args.seed,
                "counters_url": server.counters_url,
                "unique": unique,
                "out": out,
                "revision": git_revision(),
            }
            for world in args.ranks:
                for reader in args.readers:
                    store = os.path.join(tmp, f"store-{reader}-{world}")
                    mp.start_processes(
                        _rank,
                        args=(world, store, reader, url, options, shared),
                        nprocs=world,
                        join=True,
                        start_method="spawn",
                    )
            samples = [json.loads(line) for line in open(out)]
    finally:
        server.stop()
    print("\n| reader | ranks | seconds | bytes read / unique | GET requests |\n|---|---|---|---|---|")
    for s in samples:
        print(
            f"| {s['reader']} | {s['ranks']} | {s['seconds']} | {s['read_over_unique']} | {s['get_requests']} |"
        )


if __name__ == "__main__":
    main()
