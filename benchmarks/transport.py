"""The S3 read transports alone: client CPU s/GB and GB/s of reading one object in ranges.

``python -m benchmarks.transport`` starts the S3 server as ``benchmarks.run`` does (the
counting moto server in this process by default, or ``--server seaweedfs|ceph``), puts one object of ``--size-mib`` there, then reads it back in ``--range-mib`` ranges,
``--concurrency`` at a time, once per transport and repeat, each read in a fresh child process
(``--child``) whose user+sys CPU seconds are the client's cost. No checkpoint code runs: this
is what the bytes cost on the wire, the floor under a load.

Transports:

* ``s3fs-cat-ranges``: s3fs's ``cat_ranges`` (aiobotocore/aiohttp), bytes per range;
* ``s3fs-readinto``: one ranged GET per range whose body is read into a preallocated buffer
  (what dcp_fsspec's S3 backend does without obstore);
* ``obstore-async``: obstore's ``get_range_async`` per range on an asyncio loop (Rust
  ``object_store``), the ranges left in the Rust buffers it returns;
* ``obstore-async-into``: the same, each range then copied into a preallocated buffer (the
  one copy a load into existing tensors pays);
* ``obstore-stream-into``: obstore's ``get_async`` per range, its body streamed in
  ``--stream-chunk-kib`` chunks, each copied into a preallocated buffer as it arrives (what
  dcp_fsspec's obstore backend does for a load into existing tensors);
* ``obstore-threads-into``: obstore's blocking ``get_range`` from a pool of threads, copied
  into a preallocated buffer;
* ``obstore-fsspec``: obstore's fsspec ``FsspecStore.cat_ranges``.

Prints one JSON line per read and a markdown table of medians.

``--startup`` measures instead what a process pays before its first byte: in a fresh child
that has imported torch and dcp_fsspec's URL handling, the CPU seconds of importing the
transport, building its client and reading one byte of the object (``dcp_fsspec`` through
``resolve``, with s3fs or with ``transport="obstore"``; s3torchconnector's ``S3Client``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

MiB = 1024 * 1024
BUCKET = "transport"
KEY = "object.bin"
TRANSPORTS = (
    "s3fs-cat-ranges",
    "s3fs-readinto",
    "obstore-async",
    "obstore-async-into",
    "obstore-stream-into",
    "obstore-threads-into",
    "obstore-fsspec",
)


def _ranges(size: int, step: int) -> list[tuple[int, int]]:
    return [(s, min(s + step, size)) for s in range(0, size, step)]


def _s3fs(endpoint: str, key: str, secret: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(key=key, secret=secret, client_kwargs={"endpoint_url": endpoint})


def _obstore(endpoint: str, key: str, secret: str) -> Any:
    from obstore.store import S3Store

    return S3Store(
        BUCKET,
        config={
            "endpoint": endpoint,
            "access_key_id": key,
            "secret_access_key": secret,
            "region": "us-east-1",
            "virtual_hosted_style_request": False,
        },
        client_options={"allow_http": True},
    )


async def _bounded(n: int, jobs: Sequence[Callable[[], Any]]) -> list[Any]:
    gate = asyncio.Semaphore(n)

    async def one(job: Callable[[], Any]) -> Any:
        async with gate:
            return await job()

    return await asyncio.gather(*(one(j) for j in jobs))


def _reader(args: argparse.Namespace, size: int) -> Callable[[], int]:
    """A function that reads the whole object once the transport's way; returns bytes read."""
    ranges = _ranges(size, args.range_mib * MiB)
    n = args.concurrency
    t = args.child
    if t == "s3fs-cat-ranges":
        fs = _s3fs(args.endpoint, args.key, args.secret)
        path = f"{BUCKET}/{KEY}"
        return lambda: sum(
            len(b)
            for b in fs.cat_ranges(
                [path] * len(ranges),
                [a for a, _ in ranges],
                [b for _, b in ranges],
                batch_size=n,
                on_error="raise",
            )
        )
    if t == "s3fs-readinto":
        import fsspec.asyn

        from dcp_fsspec.storage.backends.s3 import S3Backend
        from dcp_fsspec.storage.transport.retry import NO_RETRY

        fs = _s3fs(args.endpoint, args.key, args.secret)
        backend = S3Backend(fs, NO_RETRY)
        buf = bytearray(size)
        view = memoryview(buf)
        path = f"{BUCKET}/{KEY}"

        async def all_ranges() -> int:
            jobs = [partial(backend.read_range_into_async, path, a, view[a:b]) for a, b in ranges]
            return sum(await _bounded(n, jobs))

        return lambda: fsspec.asyn.sync(fs.loop, all_ranges)
    if t.startswith("obstore"):
        return _obstore_reader(args, size, ranges)
    raise SystemExit(f"unknown transport {t!r}; one of {', '.join(TRANSPORTS)}")


def _obstore_reader(args: argparse.Namespace, size: int, ranges: list[tuple[int, int]]) -> Callable[[], int]:
    """:func:`_reader` for the obstore transports."""
    n = args.concurrency
    t = args.child
    import obstore

    store = _obstore(args.endpoint, args.key, args.secret)
    buf = bytearray(size)
    view = memoryview(buf)
    if t == "obstore-async":

        async def plain() -> int:
            jobs = [partial(obstore.get_range_async, store, KEY, start=a, end=b) for a, b in ranges]
            return sum(len(x) for x in await _bounded(n, jobs))

        return lambda: asyncio.run(plain())
    if t == "obstore-async-into":

        async def into() -> int:
            async def one(a: int, b: int) -> int:
                got = await obstore.get_range_async(store, KEY, start=a, end=b)
                view[a : a + len(got)] = memoryview(got)
                return len(got)

            return sum(await _bounded(n, [partial(one, a, b) for a, b in ranges]))

        return lambda: asyncio.run(into())
    if t == "obstore-stream-into":
        chunk = args.stream_chunk_kib * 1024

        async def streamed() -> int:
            async def one(a: int, b: int) -> int:
                got = 0
                result = await obstore.get_async(store, KEY, options={"range": (a, b)})
                async for piece in result.stream(min_chunk_size=chunk):
                    data = memoryview(piece)
                    view[a + got : a + got + data.nbytes] = data
                    got += data.nbytes
                return got

            return sum(await _bounded(n, [partial(one, a, b) for a, b in ranges]))

        return lambda: asyncio.run(streamed())
    if t == "obstore-threads-into":
        pool = ThreadPoolExecutor(n)

        def one_sync(a: int, b: int) -> int:
            got = obstore.get_range(store, KEY, start=a, end=b)
            view[a : a + len(got)] = memoryview(got)
            return len(got)

        return lambda: sum(pool.map(one_sync, *zip(*ranges)))
    if t == "obstore-fsspec":
        from obstore.fsspec import FsspecStore

        fs = FsspecStore(
            "s3",
            config={
                "endpoint": args.endpoint,
                "access_key_id": args.key,
                "secret_access_key": args.secret,
                "region": "us-east-1",
                "virtual_hosted_style_request": False,
            },
            client_options={"allow_http": True},
        )
        path = f"s3://{BUCKET}/{KEY}"
        return lambda: sum(
            len(b)
            for b in fs.cat_ranges([path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges])
        )
    raise SystemExit(f"unknown transport {t!r}; one of {', '.join(TRANSPORTS)}")


STARTUPS = ("dcp_fsspec-s3fs", "dcp_fsspec-obstore", "s3torchconnector")


def _startup_child(args: argparse.Namespace) -> None:
    import torch  # noqa: F401 - every implementation's process has it before its first request

    from dcp_fsspec.storage.transport.urls import resolve

    cpu0 = os.times()
    if args.child == "s3torchconnector":
        from s3torchconnector._s3client import S3Client

        os.environ.update(AWS_ACCESS_KEY_ID=args.key, AWS_SECRET_ACCESS_KEY=args.secret)
        got = S3Client("us-east-1", endpoint=args.endpoint).get_object(BUCKET, KEY).read(1)
    else:
        options: dict[str, Any] = {
            "key": args.key,
            "secret": args.secret,
            "client_kwargs": {"endpoint_url": args.endpoint, "region_name": "us-east-1"},
        }
        if args.child == "dcp_fsspec-obstore":
            options["transport"] = "obstore"
        location = resolve(f"s3://{BUCKET}/{KEY}", options)
        got = location.backend.read_range(location.path, 0, 1)
    cpu1 = os.times()
    assert len(got) == 1
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    print(json.dumps({"startup": args.child, "cpu_seconds": cpu}))


def _child(args: argparse.Namespace) -> None:
    if args.startup:
        _startup_child(args)
        return
    size = args.size_mib * MiB
    read = _reader(args, size)
    cpu0, t0 = os.times(), time.perf_counter()
    got = read()
    seconds, cpu1 = time.perf_counter() - t0, os.times()
    if got != size:
        raise SystemExit(f"{args.child}: read {got} bytes of {size}")
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    gb = size / 1e9
    print(
        json.dumps(
            {
                "transport": args.child,
                "seconds": seconds,
                "cpu_seconds": cpu,
                "user_s_per_gb": (cpu1.user - cpu0.user) / gb,
                "sys_s_per_gb": (cpu1.system - cpu0.system) / gb,
                "gb_per_s": gb / seconds,
                "cpu_s_per_gb": cpu / gb,
            }
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--range-mib", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument(
        "--stream-chunk-kib",
        type=int,
        default=1024,
        help="obstore-stream-into's smallest chunk (dcp_fsspec's obstore backend uses 1024)",
    )
    parser.add_argument("--startup", action="store_true", help="measure each process's start-up instead")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--key", default="testing", help=argparse.SUPPRESS)
    parser.add_argument("--secret", default="testing", help=argparse.SUPPRESS)
    args = parser.parse_known_args(argv)[0]
    if args.child:  # before the server's imports (moto, botocore): they would lower a start-up
        _child(parser.parse_args(argv))
        return
    from benchmarks.run import add_server_arguments, start_server

    add_server_arguments(parser)
    args = parser.parse_args(argv)
    server, _ = start_server(args, [args.size_mib], [])
    try:
        server.create_bucket(BUCKET)
        fs = _s3fs(server.endpoint_url, args.s3_key, args.s3_secret)
        fs.pipe_file(
            f"{BUCKET}/{KEY}", os.urandom(args.size_mib * MiB), chunksize=16 * MiB, max_concurrency=8
        )
        samples: dict[str, list[dict[str, Any]]] = {}
        names = list(STARTUPS) if args.startup else args.transports.split(",")
        if importlib.util.find_spec("obstore") is None:
            print(
                "obstore is not installed (pip install obstore): its transports are left out", file=sys.stderr
            )
            names = [n for n in names if not n.startswith("obstore")]
        for repeat in range(args.repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:  # rotate the order
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.transport",
                    "--child",
                    name,
                    "--endpoint",
                    server.endpoint_url,
                    "--key",
                    args.s3_key,
                    "--secret",
                    args.s3_secret,
                    "--size-mib",
                    str(args.size_mib),
                    "--range-mib",
                    str(args.range_mib),
                    "--concurrency",
                    str(args.concurrency),
                    "--stream-chunk-kib",
                    str(args.stream_chunk_kib),
                    *(["--startup"] if args.startup else []),
                ]
                out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if out.returncode:
                    print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                    continue
                line = out.stdout.strip().splitlines()[-1]
                print(line, flush=True)
                samples.setdefault(name, []).append(json.loads(line))
    finally:
        server.stop()
    if args.startup:
        print(
            f"\nstart-up CPU s per process, medians of {args.repeats}; load average {os.getloadavg()[0]:.2f}\n"
        )
        print("| client | CPU s to its first byte |\n|---|---|")
        for name, got in samples.items():
            print(f"| {name} | {statistics.median(s['cpu_seconds'] for s in got):.3f} |")
        return
    print(
        f"\n{args.size_mib} MiB in {args.range_mib} MiB ranges, {args.concurrency} at a time; "
        f"medians of {args.repeats}; load average {os.getloadavg()[0]:.2f}\n"
    )
    print("| transport | client CPU s/GB (user + sys) | GB/s |\n|---|---|---|")
    for name, got in samples.items():
        cpu, user, system, rate = (
            statistics.median(s[k] for s in got)
            for k in ("cpu_s_per_gb", "user_s_per_gb", "sys_s_per_gb", "gb_per_s")
        )
        print(f"| {name} | {cpu:.2f} ({user:.2f} + {system:.2f}) | {rate:.3f} |")


if __name__ == "__main__":
    main()
