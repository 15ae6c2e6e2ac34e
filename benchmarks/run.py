"""Run every implementation and physical reference, alternately, and write the tables.

``python -m benchmarks.run [--size-mib 1024 | --sizes 256M,1G,4G] [--ranks 2] [--server ceph]
[--repeats 3] [--out benchmarks/results]``

Starts what it needs itself: the S3 server on 127.0.0.1 (the counting moto server by default,
or SeaweedFS or Ceph RGW from ``tests/servers/``, ports chosen free), a temporary local folder,
and ``memory://`` inside the workers. Each save and each load runs
in a fresh worker process (``benchmarks.worker``); within a repeat the implementations take
turns in an order that rotates from repeat to repeat. Every worker's JSON line is echoed to
stdout as it arrives; at the end ``<out>/samples.json`` holds them all and ``<out>/results.md``
the medians, ratios and targets (also printed).
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import procmem, report
from benchmarks.impls import IMPLS
from benchmarks.s3server import CountingS3Server
from tests.servers import ServerUnavailable
from tests.servers.ceph import LocalCephRGW
from tests.servers.s3gateway import S3Gateway
from tests.servers.seaweedfs import LocalSeaweedFS

REPO = Path(__file__).resolve().parent.parent
BUCKET = "dcp-fsspec-bench"
BACKENDS = ("s3", "local", "memory")
SERVERS = {"seaweedfs": LocalSeaweedFS, "ceph": LocalCephRGW}
S3Server = CountingS3Server | S3Gateway
# What Ceph's OSD file grows to per byte of the largest state (the state under several
# implementations at once, overwritten objects until RGW's garbage collection runs): measured
# ~10 GB for a 1 GiB run.
CEPH_DISK_PER_STATE_BYTE = 10


class Runner:
    """Launches workers and keeps every sample and note."""

    def __init__(self, args: argparse.Namespace, server: S3Server, local_root: str):
        self.args = args
        self.server = server
        self.local_root = local_root
        self.samples: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.so = server.storage_options()
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, **server.environ(), "PYTHONPATH": pythonpath}
        import fsspec

        self.s3 = fsspec.filesystem("s3", **self.so)

    def worker(self, phase: str, tags: dict[str, Any], **opts: Any) -> list[dict[str, Any]]:
        """Run one worker; its samples, tagged, or an ``error`` record when it failed."""
        a = self.args
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.worker",
            phase,
            "--size-mib",
            str(tags["size_mib"]),
            "--many-small",
            str(tags["many_small"]),
            "--seed",
            str(a.seed),
            "--part-mib",
            str(a.part_mib),
            "--concurrency",
            str(a.concurrency),
        ]
        for k, v in opts.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        if tags["backend"] == "s3":
            cmd += ["--storage-options", json.dumps(self.so)]
            if isinstance(self.server, CountingS3Server):
                cmd += ["--counters-url", self.server.counters_url]
        rss_before = procmem.rss_mib()
        procmem.reset_peak()
        server_cpu_before = self.server_cpu()
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=a.timeout
            )
            rc: int | str = proc.returncode
            out, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = "timeout", _text(e.stdout)
            err = _text(e.stderr) + f"\ntimed out after {a.timeout} s"
        samples = [json.loads(line) for line in out.splitlines() if line.startswith('{"kind"')]
        if rc != 0 or not samples:
            samples = [{"kind": "error", "phase": phase, "rc": rc, "stderr_tail": err[-2000:]}]
            self.notes.append(
                f"{tags['scenario']}/{tags['backend']}/{opts.get('impl', 'raw')} "
                f"{phase} failed (rc {rc}): {_last_line(err)}"
            )
        server_peak = procmem.peak_mib() - rss_before
        server_cpu_after = self.server_cpu()
        for s in samples:
            s.update(tags)
            if tags["backend"] == "s3":
                if server_cpu_before is not None and server_cpu_after is not None:
                    s["server_cpu_seconds"] = server_cpu_after - server_cpu_before
                if isinstance(self.server, CountingS3Server):  # moto: in this process
                    s["server_peak_extra_rss_mib"] = server_peak
            s.setdefault("impl", opts.get("impl", "raw"))
            print(json.dumps(s), flush=True)
        self.samples.extend(samples)
        return samples

    # -- one implementation, one repeat --------------------------------------------------

    def run_impl(self, impl: str, backend: str, tags: dict[str, Any]) -> None:
        common = {
            "impl": impl,
            "backend": backend,
            "world_size": self.args.world_size,
            "warm": int(self.args.warm),
        }
        if backend == "memory":
            url = f"memory://bench/{tags['scenario']}/{impl}"
            self.worker("saveload", tags, url=url, **common)
            return
        url = self.url(backend, tags, impl)
        try:
            saved = self.worker("save", tags, url=url, **common)
            if saved[0]["kind"] != "sample":
                return
            saved[0]["stored_bytes"] = self.stored_bytes(backend, url)
            if backend == "local":
                drop_page_cache(url)
                self.worker("load", tags, url=url, **common)
                return
            for mode in self.get_modes():
                with self.moto_get(mode):
                    self.worker("load", {**tags, "moto_get": mode}, url=url, **common)
        finally:
            self.remove(backend, url)

    def run_ceilings(self, backend: str, tags: dict[str, Any]) -> None:
        raw = {"impl": "raw", "backend": backend}
        if backend == "memory":
            self.worker("memcopy", tags, url="unused", **raw)
            return
        url = self.url(backend, tags, "raw")
        try:
            if backend == "local":
                if self.worker("local-write", tags, url=url, **raw)[0]["kind"] == "sample":
                    self.worker("local-read", tags, url=url, **raw)
                return
            if self.worker("s3-put", tags, url=url, **raw)[0]["kind"] == "sample":
                for mode in self.get_modes():
                    with self.moto_get(mode):
                        self.worker("s3-get", {**tags, "moto_get": mode}, url=url, **raw)
        finally:
            self.remove(backend, url)

    def run_async(self, backend: str, tags: dict[str, Any]) -> bool:
        """Sync vs ``async_with_pinned_mem`` saves through ``dcp_fsspec.Checkpointer``; False
        once it is known not to run here."""
        for mode in ("async_with_pinned_mem", "disabled"):
            url = self.url(backend, tags, f"checkpointer-{mode}")
            try:
                s = self.worker("async", tags, url=url, impl="dcp_fsspec", backend=backend, async_mode=mode)[
                    0
                ]
            finally:
                self.remove(backend, url)
            if s["kind"] != "sample":
                if s["kind"] == "skip":
                    self.notes.append(f"async save skipped: {s['note']}")
                return False
        return True

    # -- helpers -------------------------------------------------------------------------

    def server_cpu(self) -> float | None:
        """user+sys seconds the S3 server has used: moto's threads are this process's only
        work while a worker runs; a gateway's are its processes' (None: not started here)."""
        if isinstance(self.server, CountingS3Server):
            t = os.times()
            return t.user + t.system
        pids = self.server.server_pids()
        return procmem.cpu_seconds(pids) if pids else None

    def get_modes(self) -> list[str]:
        if not isinstance(self.server, CountingS3Server):
            return ["ranges"]  # a real S3 server serves ranges as S3 does
        return {"both": ["ranges", "stock"]}.get(self.args.moto_get, [self.args.moto_get])

    @contextmanager
    def moto_get(self, mode: str) -> Iterator[None]:
        """Serve ranged GETs from the range (``ranges``) or as stock moto does, for a block."""
        app = self.server.app if isinstance(self.server, CountingS3Server) else None
        if app is None:
            yield
            return
        saved, app.fast_ranges = app.fast_ranges, mode == "ranges"
        try:
            yield
        finally:
            app.fast_ranges = saved

    def url(self, backend: str, tags: dict[str, Any], name: str) -> str:
        leaf = f"{tags['scenario']}/r{tags['repeat']}/{name}"
        if backend == "s3":
            return f"s3://{BUCKET}/{leaf}"
        return os.path.join(self.local_root, leaf)

    def stored_bytes(self, backend: str, url: str) -> int:
        if backend == "s3":
            self.s3.invalidate_cache()
            return int(self.s3.du(url))
        return sum(f.stat().st_size for f in Path(url).rglob("*") if f.is_file())

    def remove(self, backend: str, url: str) -> None:
        if backend == "s3":
            self.s3.invalidate_cache()
            if self.s3.exists(url):
                self.s3.rm(url, recursive=True)
        elif os.path.isdir(url):
            shutil.rmtree(url)
        elif os.path.exists(url):
            os.remove(url)


def drop_page_cache(root: str) -> None:
    """Make the next read of ``root``'s files come from the disk: flush, then drop them."""
    for path in Path(root).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def git_revision() -> str | None:
    """The commit the run measured, ``+dirty`` with uncommitted changes; None outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument(
        "--size-mib",
        type=int,
        default=1024,
        help="tensor data in the realistic state (0: skip that scenario)",
    )
    p.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        metavar="256M,1G,4G",
        help="a sweep: the realistic state at each size (instead of --size-mib), "
        "and a table of GB/s, CPU s/GB and +RSS per size",
    )
    p.add_argument(
        "--many-small",
        type=int,
        default=0,
        metavar="N",
        help="also run a state of N small tensors (e.g. 10000)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--world-size",
        "--ranks",
        dest="world_size",
        type=int,
        default=1,
        help="ranks per save/load (gloo); each rank saves its own keys",
    )
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument(
        "--moto-get",
        choices=["ranges", "stock", "both"],
        default=None,
        help="how the server answers ranged GETs during loads: from the range "
        "(like S3), reading the whole object like stock moto, or each in turn "
        "(default: both up to 1024 MiB, ranges above: stock GETs hold a copy "
        "of the whole object per concurrent request)",
    )
    add_server_arguments(p)
    p.add_argument("--no-async", action="store_true", help="skip the Checkpointer async hook")
    p.add_argument(
        "--warm",
        action="store_true",
        help="each save and load after an untimed small one of the same implementation "
        "in its process: a training run's later saves, not its first",
    )
    p.add_argument("--part-mib", type=int, default=16, help="part / range size of the raw s3fs references")
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="concurrent requests (s3) or files (local) of the raw references",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per worker")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.moto_get is None:
        args.moto_get = "both" if max(args.sizes or [args.size_mib]) <= 1024 else "ranges"
    return args


def parse_sizes(text: str) -> list[int]:
    """``256M,1G,4G`` → MiB each (a plain number is MiB)."""
    sizes = []
    for item in filter(None, (t.strip().upper() for t in text.split(","))):
        factor = {"G": 1024, "M": 1}.get(item[-1], 0)
        try:
            sizes.append(int(item[:-1] if factor else item) * (factor or 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a size such as 256M or 4G") from None
    return sizes


def size_label(mib: int) -> str:
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The options that pick the S3 server a benchmark measures (see :func:`start_server`),
    shared by ``benchmarks.run``, ``benchmarks.small`` and ``benchmarks.tiers``."""
    p.add_argument(
        "--moto-complete",
        choices=["lean", "stock"],
        default="lean",
        help="CompleteMultipartUpload with one copy of the object (lean) or moto's "
        "own (~5 copies in memory, ~80 MB/s here)",
    )
    p.add_argument(
        "--server",
        choices=["moto", *SERVERS],
        default="moto",
        help="the S3 server to start on 127.0.0.1: moto in this process (counts "
        "requests), or SeaweedFS / Ceph RGW (tests/servers/; installed apart)",
    )
    p.add_argument(
        "--s3-endpoint",
        default=None,
        metavar="URL",
        help="a running S3 server instead of starting one; no request counters, no server CPU then",
    )
    p.add_argument("--s3-key", default="testing", help="access key for --s3-endpoint")
    p.add_argument("--s3-secret", default="testing", help="secret key for --s3-endpoint")
    p.add_argument("--local-dir", default=None, help="parent of the temporary local folder")


def start_server(args: argparse.Namespace, sizes: list[int], notes: list[str]) -> tuple[S3Server, list[int]]:
    """The S3 server the run measures, started; and the sizes it has room for (Ceph's OSD
    disk is a file that grows with what is stored: a size that does not fit is skipped)."""
    if args.s3_endpoint:
        return S3Gateway(args.s3_endpoint, args.s3_key, args.s3_secret), sizes
    if args.server == "moto":
        return CountingS3Server(lean_complete=args.moto_complete == "lean").start(), sizes
    parent = args.local_dir or tempfile.gettempdir()
    if args.server == "ceph":
        # The local folder of the same run shares the disk: two copies of the state at most.
        room = shutil.disk_usage(parent).free - 2 * (max(sizes) << 20)
        fits = [n for n in sizes if CEPH_DISK_PER_STATE_BYTE * (n << 20) <= room]
        for n in sorted(set(sizes) - set(fits)):
            notes.append(
                f"{size_label(n)} skipped on Ceph: its OSD needs ~{CEPH_DISK_PER_STATE_BYTE * n / 1024:.0f} GiB "
                f"of disk, {room / 2**30:.0f} GiB free under {parent}"
            )
        if not fits:
            raise SystemExit("; ".join(notes))
        server: S3Gateway = LocalCephRGW(disk_gib=-(-CEPH_DISK_PER_STATE_BYTE * max(fits) // 1024) + 4)
        sizes = fits
    else:
        server = SERVERS[args.server]()
    try:
        return server.start(), sizes
    except ServerUnavailable as e:
        raise SystemExit(f"--server {args.server}: {e}") from e


def byte_compile() -> None:
    """Compile the repository's modules to ``.pyc`` once, as ``pip install`` does for an
    installed package. Run from a checkout with ``PYTHONDONTWRITEBYTECODE`` set, every fresh
    worker would otherwise compile dcp_fsspec from source (0.03-0.1 CPU s a process here), a cost
    no installed copy pays and no peer (installed from wheels) pays either. A ``.pyc`` written
    here is still read under that setting."""
    for package in ("dcp_fsspec", "benchmarks"):
        compileall.compile_dir(str(REPO / package), quiet=1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    byte_compile()
    backends = [b for b in args.backends.split(",") if b]
    impls = [i for i in args.impls.split(",") if i]
    notes: list[str] = []
    if args.world_size > 1 and "memory" in backends:
        backends.remove("memory")
        notes.append("memory:// skipped: it lives in one process, and world size > 1")
    for name in list(impls):
        why = IMPLS[name].unavailable()
        if why:
            impls.remove(name)
            notes.append(f"{name} skipped: {why}")
    sizes = args.sizes or ([args.size_mib] if args.size_mib > 0 else [])
    server: S3Server = S3Gateway()  # without S3: nothing to start, nothing measured on it
    if "s3" in backends:
        server, sizes = start_server(args, sizes, notes)
    scenarios = [
        {"scenario": f"state-{size_label(n)}" if args.sizes else "state", "size_mib": n, "many_small": 0}
        for n in sizes
    ]
    if args.many_small > 0:
        scenarios.append({"scenario": "many-small", "size_mib": 0, "many_small": args.many_small})
    if args.warm:
        notes.append(
            "--warm: every save and load is a later one in its process, after an untimed save (and "
            "load) of a small state with the same implementation; the raw references are as without it"
        )
    for n in notes:
        print(f"note: {n}", file=sys.stderr, flush=True)

    started = datetime.datetime.now(datetime.timezone.utc)
    revision = git_revision()
    local_root = tempfile.mkdtemp(prefix="dcp-fsspec-bench-", dir=args.local_dir)
    try:
        runner = Runner(args, server, local_root)
        runner.notes.extend(notes)
        async_ok = not args.no_async and "dcp_fsspec" in impls
        if "s3" in backends:
            server.create_bucket(BUCKET)
        for repeat in range(args.repeats):
            for scen in scenarios:
                for backend in backends:
                    here = [i for i in impls if backend in IMPLS[i].backends]
                    k = repeat % max(1, len(here))
                    tags = {**scen, "backend": backend, "repeat": repeat}
                    for impl in here[k:] + here[:k]:
                        runner.run_impl(impl, backend, tags)
                    runner.run_ceilings(backend, tags)
                    if async_ok and scen["scenario"] == "state" and backend != "memory":
                        async_ok = runner.run_async(backend, tags)
    finally:
        server.stop()
        shutil.rmtree(local_root, ignore_errors=True)

    meta = {
        "date": started.isoformat(timespec="seconds"),
        "commit": revision,
        "machine": report.machine(),
        "args": vars(args),
        "s3_server": args.s3_endpoint or args.server,
        "impls": {i: IMPLS[i].label for i in impls},
        "notes": runner.notes,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    everything = {"meta": meta, "samples": runner.samples}
    (out / "samples.json").write_text(json.dumps(everything, indent=1))
    md = report.render(meta, runner.samples)
    (out / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
