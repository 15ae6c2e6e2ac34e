"""One measured run in a fresh process; prints one JSON line per measurement.

``python -m benchmarks.worker PHASE ...`` where PHASE is

* ``save`` / ``load`` — ``dcp.save`` / ``dcp.load`` of the benchmark state with ``--impl`` at
  ``--url``; a load checks every entry bit for bit afterwards (untimed);
* ``saveload`` — both in one process, for ``memory://`` (which lives and dies with a process);
* ``memcopy``, ``local-write``, ``local-read``, ``s3-put``, ``s3-get`` — the physical
  references: one clone of the state; the same bytes written with fsync and read back cold
  as ``--concurrency`` local files in parallel; put as one concurrent multipart upload and read back with concurrent
  ranged GETs by s3fs;
* ``async`` — how long ``dcp_fsspec.Checkpointer.save`` blocks, with ``--async-mode``
  (``disabled``: the sync save to compare with).

Each measurement reports seconds, the tensor bytes moved, the worker's peak RSS above what it
held before the phase (``/proc/self/clear_refs`` resets ``VmHWM``; Linux only), and with
``--counters-url`` what the S3 server saw during the phase. With ``--world-size`` > 1 the
worker spawns that many gloo ranks, each saving or loading its own keys; rank 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import resource
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import torch

from benchmarks import procmem
from benchmarks import state as st
from benchmarks.impls import IMPLS
from benchmarks.s3server import delta, fetch_counters

_CHUNK = 64 * st.MiB


def measure(fn: Callable[[], Any], counters_url: str | None, barrier: Callable[[], None]) -> dict:
    """Time ``fn`` with the peak-RSS, CPU-time and server-counter bookkeeping around it."""
    gc.collect()
    before = fetch_counters(counters_url) if counters_url else None
    barrier()
    rss_before = procmem.rss_mib()
    peak_reset = procmem.reset_peak()
    cpu0 = os.times()
    use0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    result = fn()
    barrier()
    seconds = time.perf_counter() - t0
    cpu1 = os.times()
    use1 = resource.getrusage(resource.RUSAGE_SELF)
    peak = procmem.peak_mib()
    after = fetch_counters(counters_url) if counters_url else None
    out: dict[str, Any] = {
        "seconds": seconds,
        "rss_before_mib": rss_before,
        "peak_extra_rss_mib": peak - rss_before if peak_reset else None,
        # user+sys seconds of this process (every thread): what the client costs the machine.
        "cpu_seconds": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
        # The kernel's share (page-cache copies, reclaim, page faults) and the faults: on local
        # disk what grows with the state's size shows here, not in Python.
        "sys_seconds": cpu1.system - cpu0.system,
        "minor_faults": use1.ru_minflt - use0.ru_minflt,
        "major_faults": use1.ru_majflt - use0.ru_majflt,
        "result": result,
    }
    if before is not None and after is not None:
        out["server"] = delta(before, after)
    return out


def _entries(args: argparse.Namespace, rank: int, world_size: int) -> list[st.Entry]:
    return st.for_rank(args.size_mib, args.seed, many=args.many_small, rank=rank, world_size=world_size)


def _phase_sample(args: argparse.Namespace, phase: str, entries: list[st.Entry], m: dict) -> dict:
    nbytes = st.nbytes(entries)
    return {
        "kind": "sample",
        "phase": phase,
        "impl": args.impl,
        "backend": args.backend,
        "nbytes": nbytes,
        **{k: v for k, v in m.items() if k != "result"},
        "gbps": nbytes / m["seconds"] / 1e9,
    }


def _save(args: argparse.Namespace, entries: list[st.Entry], barrier: Callable[[], None]) -> dict:
    import torch.distributed.checkpoint as dcp

    impl = IMPLS[args.impl]
    state = st.build(entries)
    so = json.loads(args.storage_options)
    m = measure(
        lambda: dcp.save(state, storage_writer=impl.writer(args.url, so)),
        args.counters_url,
        barrier,
    )
    return _phase_sample(args, "save", entries, m)


def _load(args: argparse.Namespace, entries: list[st.Entry], barrier: Callable[[], None]) -> dict:
    import torch.distributed.checkpoint as dcp

    impl = IMPLS[args.impl]
    target = st.template(entries)
    so = json.loads(args.storage_options)
    m = measure(
        lambda: dcp.load(target, storage_reader=impl.reader(args.url, so)),
        args.counters_url,
        barrier,
    )
    bad = st.verify(entries, target)
    return {**_phase_sample(args, "load", entries, m), "verified": not bad, "mismatches": bad[:5]}


def _run_ranks(args: argparse.Namespace, phases: list[str]) -> list[dict]:
    if args.world_size == 1:
        return _dcp_phases(args, phases, 0, 1, lambda: None)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, (args, phases, tmp), nprocs=args.world_size)
        per_rank = []
        for r in range(args.world_size):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return [_combine([samples[i] for samples in per_rank]) for i in range(len(phases))]


def _rank_main(rank: int, args: argparse.Namespace, phases: list[str], tmp: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=args.world_size)
    try:
        # Only rank 0 reads the server's counters: once per phase, for all ranks.
        if rank:
            args = argparse.Namespace(**{**vars(args), "counters_url": None})
        samples = _dcp_phases(args, phases, rank, args.world_size, dist.barrier)
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(samples, f)
    finally:
        dist.destroy_process_group()


def _dcp_phases(
    args: argparse.Namespace,
    phases: list[str],
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
) -> list[dict]:
    entries = _entries(args, rank, world_size)
    if not args.warm:
        return [(_save if p == "save" else _load)(args, entries, barrier) for p in phases]
    with _warmed_up(args, entries, phases, rank, barrier):
        return [(_save if p == "save" else _load)(args, entries, barrier) for p in phases]


@contextlib.contextmanager
def _warmed_up(
    args: argparse.Namespace,
    entries: list[st.Entry],
    phases: list[str],
    rank: int,
    barrier: Callable[[], None],
) -> Iterator[None]:
    """``--warm``: before the measured phase, the same implementation saves (and for a load,
    loads) a small state in this process, untimed: the smallest tensor of each dtype. The
    phase is then what every save of a training run after its first costs (modules imported,
    clients built, connections open), where a fresh process measures the first one. The
    warm-up's folder is removed afterwards."""
    import torch.distributed.checkpoint as dcp

    impl = IMPLS[args.impl]
    so = json.loads(args.storage_options)
    smallest: dict[str, st.Entry] = {}
    for e in entries:
        if e.is_tensor and (e.dtype not in smallest or e.nbytes < smallest[e.dtype].nbytes):
            smallest[e.dtype] = e
    picked = list(smallest.values())
    url = args.url.rstrip("/") + "-warmup"
    try:
        dcp.save(st.build(picked), storage_writer=impl.writer(url, so))
        if "load" in phases:
            dcp.load(st.template(picked), storage_reader=impl.reader(url, so))
        barrier()
        yield
    finally:
        barrier()
        if rank == 0:
            fs, path = fsspec.core.url_to_fs(url, **so)
            if fs.exists(path):
                fs.rm(path, recursive=True)


def _combine(samples: list[dict]) -> dict:
    """One sample for all ranks: the slowest rank's seconds, all ranks' bytes, the largest
    per-rank peak RSS, rank 0's view of the server."""
    out = dict(samples[0])
    out["seconds"] = max(s["seconds"] for s in samples)
    out["nbytes"] = sum(s["nbytes"] for s in samples)
    out["gbps"] = out["nbytes"] / out["seconds"] / 1e9
    for key in ("cpu_seconds", "sys_seconds", "minor_faults", "major_faults"):
        out[key] = sum(s[key] for s in samples)
    peaks = [s["peak_extra_rss_mib"] for s in samples if s["peak_extra_rss_mib"] is not None]
    out["peak_extra_rss_mib"] = max(peaks) if peaks else None
    if "verified" in out:
        out["verified"] = all(s["verified"] for s in samples)
        out["mismatches"] = [n for s in samples for n in s["mismatches"]][:5]
    return out


# --- physical references -------------------------------------------------------------------


def _payload(entries: list[st.Entry]) -> bytearray:
    """All tensor bytes of the state laid end to end in one buffer (a ``bytearray``: botocore
    takes bytes, bytearray or a file as a body, not a memoryview)."""
    out = bytearray(st.nbytes(entries))
    view = memoryview(out)
    pos = 0
    for b in st.tensor_bytes(entries):
        view[pos : pos + b.numel()] = b.numpy().data
        pos += b.numel()
    return out


def _digest(chunks: Iterable[Any]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for c in chunks:
        h.update(c.numpy().data if isinstance(c, torch.Tensor) else c)
    return h.hexdigest()


# Each reference: set up (untimed), then return the timed call and a check of what it read.
Timed = tuple[Callable[[], Any], Callable[[Any], bool | None]]


def _memcopy(args: argparse.Namespace, entries: list[st.Entry]) -> Timed:
    state = st.build(entries)

    def clone() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}

    return clone, lambda _: None


def _slices(total: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous byte ranges covering ``[0, total)``, one per file."""
    step = -(-total // n)
    return [(a, min(a + step, total)) for a in range(0, total, step)] or [(0, 0)]


def _local_write(args: argparse.Namespace, entries: list[st.Entry]) -> Timed:
    # The same bytes as --concurrency files written in parallel, each fsynced: as many streams
    # as dcp_fsspec's writer uses (files_per_rank=8), so the reference is not one stream's speed.
    data = memoryview(_payload(entries))

    def write_one(index: int, lo: int, hi: int) -> None:
        with open(os.path.join(args.url, str(index)), "wb", buffering=0) as f:
            for pos in range(lo, hi, _CHUNK):
                f.write(data[pos : min(pos + _CHUNK, hi)])
            os.fsync(f.fileno())
            # The read that follows must come from the disk, not the page cache.
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def write() -> None:
        os.makedirs(args.url, exist_ok=True)
        with ThreadPoolExecutor(args.concurrency) as pool:
            for f in [
                pool.submit(write_one, i, lo, hi)
                for i, (lo, hi) in enumerate(_slices(len(data), args.concurrency))
            ]:
                f.result()

    return write, lambda _: None


def _local_read(args: argparse.Namespace, entries: list[st.Entry]) -> Timed:
    # Filled (not calloc'ed) so its pages exist before the clock starts, as a load target's do.
    buf = bytearray(b"\1") * st.nbytes(entries)

    def read_one(index: int, lo: int, hi: int) -> None:
        view = memoryview(buf)
        path = os.path.join(args.url, str(index))
        with open(path, "rb", buffering=0) as f:
            pos = lo
            while pos < hi:
                n = f.readinto(view[pos : min(pos + _CHUNK, hi)])
                if not n:
                    raise EOFError(f"{path} ends at byte {pos - lo} of {hi - lo}")
                pos += n

    def read() -> bytearray:
        with ThreadPoolExecutor(args.concurrency) as pool:
            for f in [
                pool.submit(read_one, i, lo, hi)
                for i, (lo, hi) in enumerate(_slices(len(buf), args.concurrency))
            ]:
                f.result()
        return buf

    return read, lambda got: _digest([got]) == _digest(st.tensor_bytes(entries))


def _s3_put(args: argparse.Namespace, entries: list[st.Entry]) -> Timed:
    fs, path = fsspec.core.url_to_fs(args.url, **json.loads(args.storage_options))
    data = _payload(entries)
    part = args.part_mib * st.MiB
    return (
        lambda: fs.pipe_file(path, data, chunksize=part, max_concurrency=args.concurrency),
        lambda _: None,
    )


def _s3_get(args: argparse.Namespace, entries: list[st.Entry]) -> Timed:
    fs, path = fsspec.core.url_to_fs(args.url, **json.loads(args.storage_options))
    size = fs.info(path)["size"]
    part = args.part_mib * st.MiB
    starts = list(range(0, size, part))
    ends = [min(s + part, size) for s in starts]

    def get() -> list[bytes]:
        return fs.cat_ranges(
            [path] * len(starts), starts, ends, batch_size=args.concurrency, on_error="raise"
        )

    return get, lambda got: _digest(got) == _digest(st.tensor_bytes(entries))


CEILINGS: dict[str, Callable[[argparse.Namespace, list[st.Entry]], Timed]] = {
    "memcopy": _memcopy,
    "local-write": _local_write,
    "local-read": _local_read,
    "s3-put": _s3_put,
    "s3-get": _s3_get,
}


def _ceiling(args: argparse.Namespace) -> dict:
    entries = _entries(args, 0, 1)
    fn, check = CEILINGS[args.phase](args, entries)
    m = measure(fn, args.counters_url, lambda: None)
    verified = check(m.pop("result"))
    sample = _phase_sample(args, args.phase, entries, m)
    if verified is not None:
        sample["verified"] = verified
    if args.phase.startswith("s3"):
        sample.update(part_mib=args.part_mib, concurrency=args.concurrency)
    return sample


# --- async hook ----------------------------------------------------------------------------


def _async(args: argparse.Namespace) -> dict:
    """Seconds ``Checkpointer.save`` blocks the caller, and until ``finalize`` returns (the
    checkpoint committed), with ``async_mode=--async-mode`` ("disabled" is the sync save)."""
    base = {"kind": "sample", "phase": f"async:{args.async_mode}", "impl": args.impl, "backend": args.backend}
    try:
        from dcp_fsspec import Checkpointer
    except ImportError as e:
        return {**base, "kind": "skip", "note": f"dcp_fsspec.Checkpointer unavailable: {e}"}
    so = json.loads(args.storage_options)
    try:
        ckpt = Checkpointer(args.url, so, async_mode=args.async_mode)
    except ValueError as e:
        note = f"Checkpointer(async_mode={args.async_mode!r}): {e}"
        return {**base, "kind": "skip", "note": note}
    entries = _entries(args, 0, 1)
    model = st.build(entries)
    t0 = time.perf_counter()
    ckpt.save(1, model=model)
    blocked = time.perf_counter() - t0
    ckpt.finalize() if args.async_mode == "disabled" else ckpt.wait()
    total = time.perf_counter() - t0
    nbytes = st.nbytes(entries)
    sample = {
        **base,
        "nbytes": nbytes,
        "seconds": blocked,
        "total_seconds": total,
        "gbps": nbytes / total / 1e9,
    }
    if args.async_mode != "disabled":
        # A later save reuses the staging buffers the first one allocated: what a training run
        # pays at every save after its first. Next to it, one copy_ of the state into
        # preallocated memory, the least any staging can cost.
        t0 = time.perf_counter()
        ckpt.save(2, model=model)
        sample["later_seconds"] = time.perf_counter() - t0
        ckpt.finalize()
        tensors = [v for v in model.values() if isinstance(v, torch.Tensor)]
        copies = [t.clone() for t in tensors]  # the pages exist before the clock starts
        t0 = time.perf_counter()
        for dst, src in zip(copies, tensors):
            dst.copy_(src)
        sample["copy_seconds"] = time.perf_counter() - t0
    return sample


# --- entry point ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.worker", description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=["save", "load", "saveload", "async", *CEILINGS])
    p.add_argument("--impl", default="")
    p.add_argument("--backend", default="")
    p.add_argument("--url", required=True)
    p.add_argument("--storage-options", default="{}", help="JSON dict")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--many-small", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--counters-url", default=None)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--async-mode", default="async_with_pinned_mem", help="disabled: sync save")
    p.add_argument("--warm", type=int, choices=[0, 1], default=0, help="1: an untimed small save/load first")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    if args.phase in CEILINGS:
        samples = [_ceiling(args)]
    elif args.phase == "async":
        samples = [_async(args)]
    else:
        phases = ["save", "load"] if args.phase == "saveload" else [args.phase]
        samples = _run_ranks(args, phases)
    for s in samples:
        s.update(world_size=args.world_size, size_mib=args.size_mib, many_small=args.many_small)
        if args.warm:
            s["warm"] = True
        print(json.dumps(s), flush=True)


if __name__ == "__main__":
    main()
