"""What signing every upload body costs obstore's client: PUTs with and without ``unsigned_payload``.

``python -m benchmarks.obstore_signing [--size-mib 256] [--repeats 2] [--server seaweedfs]``

Over SigV4, ``object_store`` hashes each body with SHA-256 for the signature unless
``unsigned_payload`` is set; botocore does so only over ``http://``. Starts the S3 server as
``benchmarks.run`` does, then in fresh child processes (``--child``), signed and unsigned in
turn, uploads ``--size-mib`` of random bytes twice: as 16 single PUTs of views, the way
dcp_fsspec commits a small file, and through one multipart writer in 16 MiB parts. Each child
prints one JSON line per upload with its client CPU seconds per 10^9 bytes; a markdown table of
medians follows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.run import BUCKET, REPO, add_server_arguments, start_server

MiB = 1024 * 1024
FILES = 16
MODES = ("signed", "unsigned")


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _child(args: argparse.Namespace) -> None:
    import obstore
    from obstore.store import S3Store

    config = {
        "endpoint": args.endpoint,
        "access_key_id": args.key,
        "secret_access_key": args.secret,
        "region": "us-east-1",
        "unsigned_payload": args.child == "unsigned",
    }
    store = S3Store(BUCKET, config=config, client_options={"allow_http": True})
    body = memoryview(os.urandom(args.size_mib * MiB))
    step = body.nbytes // FILES

    async def single_puts() -> None:
        await asyncio.gather(
            *(
                obstore.put_async(
                    store, f"signing/{i}", [body[i * step : (i + 1) * step]], use_multipart=False
                )
                for i in range(FILES)
            )
        )

    def multipart() -> None:
        with obstore.open_writer(store, "signing/multipart", buffer_size=16 * MiB, max_concurrency=8) as w:
            for at in range(0, body.nbytes, MiB):
                w.write(body[at : at + MiB])

    for upload, run in (("single PUTs", lambda: asyncio.run(single_puts())), ("multipart", multipart)):
        cpu, start = _cpu(), time.perf_counter()
        run()
        cpu, seconds = _cpu() - cpu, time.perf_counter() - start
        gb = body.nbytes / 1e9
        line = {"mode": args.child, "upload": upload, "cpu_s_per_gb": cpu / gb, "gb_per_s": gb / seconds}
        print(json.dumps(line), flush=True)
    sys.stdout.flush()
    os._exit(0)  # obstore's runtime threads can abort a normal interpreter exit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.obstore_signing", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    add_server_arguments(parser)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--key", default="testing", help=argparse.SUPPRESS)
    parser.add_argument("--secret", default="testing", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return
    server, _ = start_server(args, [args.size_mib], [])
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        server.create_bucket(BUCKET)
        endpoint = server.endpoint_url
        for repeat in range(args.repeats):
            for mode in MODES[repeat % 2 :] + MODES[: repeat % 2]:  # alternate which goes first
                cmd = [sys.executable, "-m", "benchmarks.obstore_signing", "--child", mode]
                cmd += ["--endpoint", endpoint, "--size-mib", str(args.size_mib)]
                out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
                if out.returncode or not lines:
                    print(f"{mode}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                for line in lines:
                    print(line, flush=True)
                    s = json.loads(line)
                    samples.setdefault((s["upload"], mode), []).append(s)
    finally:
        server.stop()
    print(f"\n{args.size_mib} MiB, medians of {args.repeats}; load average {os.getloadavg()[0]:.2f}\n")
    print("| upload | payload | client CPU s/GB | GB/s |\n|---|---|---|---|")
    for (upload, mode), got in samples.items():
        cpu = statistics.median(s["cpu_s_per_gb"] for s in got)
        rate = statistics.median(s["gb_per_s"] for s in got)
        print(f"| {upload} | {mode} | {cpu:.2f} | {rate:.3f} |")


if __name__ == "__main__":
    main()
