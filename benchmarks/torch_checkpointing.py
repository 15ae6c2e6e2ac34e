"""torch_checkpointing's ``CheckpointManager`` on S3 through our storage, against the baselines.

One state (``benchmarks/state.py``'s realistic mix, ``--size-mib``) saved and loaded by:

* ``tc-ours-s3``: their manager (synchronous saver), our ``FsspecStorage`` on moto; the commit
  is their folder rename, done as server-side copies.
* ``tc-ours-s3-marker``: the same with ``commit_by_marker``: the commit writes one empty file.
* ``tc-theirs-local``: their manager with their own ``LocalFileSystemStorage`` on local disk,
  buffered (``use_direct_io=False``); the page cache is dropped before the load.
* ``checkpointer-s3``: our own ``Checkpointer`` on moto.

Each save and each load runs in a fresh process (``--worker``), so ``time.process_time`` there
is the client's CPU alone, taken around the save or load call. Moto runs in this process
(``benchmarks/s3server.py``, counting requests): its CPU is this process's CPU while a worker
runs (imports and building the state included, which cost the server nothing), reported as
``server_cpu_s``.
The commit is timed from their pre-finalize callback (after the last file is written) to the
return of ``save``. Its copies are the server's copy requests in that window (CopyObject, and
UploadPartCopy for files above 150 MiB); a rename copies each file of the step whole, once.
Every load is checked bit for bit, untimed. Each run prints one JSON line; a markdown table
closes the run.

::

    python -m benchmarks.torch_checkpointing                       # 1 GiB
    python -m benchmarks.torch_checkpointing --size-mib 128 --impls tc-ours-s3 tc-ours-s3-marker
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

from benchmarks import state as st
from benchmarks.run import drop_page_cache, git_revision
from benchmarks.s3server import CountingS3Server, delta, fetch_counters

IMPLS = ("tc-ours-s3", "tc-ours-s3-marker", "tc-theirs-local", "checkpointer-s3")
BUCKET = "bench"
STEP = "step_1"
# The server's counters and the time when the last file of a save was written: their
# pre-finalize callback runs just before the commit.
_WRITTEN: list[tuple[dict[str, dict[str, float]], float]] = []
_COUNTERS_URL: list[str] = []


def _stamp(args: Any) -> None:
    _WRITTEN.append((_counters(), time.perf_counter()))


def _counters() -> dict[str, dict[str, float]]:
    return fetch_counters(_COUNTERS_URL[0]) if _COUNTERS_URL else {}


def _copies(ops: dict[str, dict[str, float]]) -> int:
    """Server-side copy requests among ``ops``: CopyObject, and UploadPartCopy, which s3fs uses
    above 150 MiB and the server counts as UploadPart (no part is uploaded during a commit)."""
    return int(sum(ops.get(op, {}).get("requests", 0) for op in ("CopyObject", "UploadPart")))


def _manager(spec: dict[str, Any]) -> Any:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    from dcp_fsspec.integrations.torch_checkpointing import FsspecStorageConfig, commit_by_marker

    config = CheckpointManager.Config.with_sync_save()
    config.pre_finalize_callback = _stamp
    if spec["impl"] == "tc-theirs-local":
        # Their default, O_DIRECT, fails here at the close of a file whose size is not a block multiple.
        config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
        return config.build()
    config.storage_config = FsspecStorageConfig(url=spec["url"], storage_options=spec["storage_options"])
    return (commit_by_marker(config) if spec["impl"] == "tc-ours-s3-marker" else config).build()


def _checkpoint_id(spec: dict[str, Any]) -> str:
    return os.path.join(spec["url"], STEP) if spec["impl"] == "tc-theirs-local" else STEP


def _save(spec: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    if spec["impl"] == "checkpointer-s3":
        from dcp_fsspec import Checkpointer

        with Checkpointer(spec["url"], spec["storage_options"]) as ckpt:
            t0, cpu = time.perf_counter(), time.process_time()
            before = _counters()
            ckpt.save(1, model=state)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu
            # Its commit is not timed apart; a copy would show as a CopyObject.
            ops = delta(before, _counters())
            return {
                "seconds": seconds,
                "cpu_seconds": cpu,
                "copy_requests": int(ops.get("CopyObject", {}).get("requests", 0)),
            }
    manager = _manager(spec)
    try:
        t0, cpu = time.perf_counter(), time.process_time()
        manager.save(_checkpoint_id(spec), {"model": state})
        end, cpu = time.perf_counter(), time.process_time() - cpu
    finally:
        manager.close()
    written, written_at = _WRITTEN[-1]
    return {
        "seconds": end - t0,
        "cpu_seconds": cpu,
        "commit_seconds": round(end - written_at, 3),
        "copy_requests": _copies(delta(written, _counters())),
    }


def _load(spec: dict[str, Any], into: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    if spec["impl"] == "checkpointer-s3":
        from dcp_fsspec import Checkpointer

        with Checkpointer(spec["url"], spec["storage_options"]) as ckpt:
            t0, cpu = time.perf_counter(), time.process_time()
            ckpt.load(model=into)
            return into, {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - cpu}
    if spec["impl"] == "tc-theirs-local":
        drop_page_cache(spec["url"])
    manager = _manager(spec)
    try:
        t0, cpu = time.perf_counter(), time.process_time()
        loaded = manager.load(_checkpoint_id(spec), into={"model": into})
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu
    finally:
        manager.close()
    return dict(loaded["model"]), {"seconds": seconds, "cpu_seconds": cpu}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One save or one load in this process: its wall and CPU seconds, and the commit's copies.

    Both clocks cover the save or load call alone: not the imports, nor building the state."""
    entries = st.realistic(spec["size_mib"], spec["seed"])
    if spec.get("counters_url"):
        _COUNTERS_URL.append(spec["counters_url"])
    if spec["phase"] == "save":
        return _save(spec, st.build(entries))
    loaded, result = _load(spec, st.template(entries))
    bad = st.verify(entries, loaded)
    if bad:
        raise AssertionError(f"{spec['impl']}: {len(bad)} entries differ after the load, e.g. {bad[:3]}")
    return result


def _run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` run by a fresh ``--worker`` process, niced as this one is; its result."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.torch_checkpointing", "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{spec['impl']} {spec['phase']} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _step_bytes(spec: dict[str, Any]) -> int:
    """The bytes of the saved step's files."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(spec["url"], **spec["storage_options"])
    fs.invalidate_cache()
    sizes = [
        int(info["size"])
        for info in fs.find(
            f"{root}/{STEP}" if spec["impl"] != "checkpointer-s3" else root, detail=True
        ).values()
    ]
    return sum(sizes)


def _remove(spec: dict[str, Any]) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(spec["url"], **spec["storage_options"])
    fs.rm(root, recursive=True)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Save then load ``spec``'s state; one row: GB/s, client and server CPU, the commit."""
    gb = st.nbytes(st.realistic(spec["size_mib"], spec["seed"])) / 1e9
    row: dict[str, Any] = {"bench": "torch_checkpointing", "impl": spec["impl"], "size_mib": spec["size_mib"]}
    for phase in ("save", "load"):
        server_cpu = time.process_time()
        result = _run_worker({**spec, "phase": phase})
        server_cpu = time.process_time() - server_cpu
        row[f"{phase}_gb_per_s"] = round(gb / result["seconds"], 3)
        row[f"{phase}_cpu_s_per_gb"] = round(result["cpu_seconds"] / gb, 3)
        row[f"{phase}_server_cpu_s"] = round(server_cpu, 2) if spec.get("counters_url") else None
        if phase == "save":
            # A rename copies each file of the step whole, once; the marker copies nothing.
            size, copies = _step_bytes(spec), result.get("copy_requests", 0)
            row.update(
                commit_seconds=result.get("commit_seconds"),
                copy_requests=copies,
                bytes_copied=size if copies else 0,
                step_bytes=size,
            )
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="tensor data of the state")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local-dir", default=None, help="parent of the temporary local folder")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    revision = git_revision()
    rows: list[dict[str, Any]] = []
    server = CountingS3Server().start()
    try:
        for name, value in server.environ().items():
            os.environ.setdefault(name, value)
        with tempfile.TemporaryDirectory(prefix="bench-tc-", dir=args.local_dir) as local:
            for n, impl in enumerate(args.impls):
                spec: dict[str, Any] = {"impl": impl, "size_mib": args.size_mib, "seed": args.seed}
                if impl == "tc-theirs-local":
                    spec.update(url=os.path.join(local, impl), storage_options={})
                    os.makedirs(spec["url"])
                else:
                    server.create_bucket(f"{BUCKET}-{n}")
                    spec.update(
                        url=f"s3://{BUCKET}-{n}/run",
                        storage_options=server.storage_options(),
                        counters_url=server.counters_url,
                    )
                row = {**measure(spec), "revision": revision}
                print(json.dumps(row), flush=True)
                rows.append(row)
                _remove(spec)  # moto keeps objects in this process's memory
    finally:
        server.stop()
    _table(rows)


def _table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| impl | save GB/s | load GB/s | save CPU s/GB | load CPU s/GB | server CPU s (save, load) "
        "| commit s | bytes copied by the commit |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        server = (
            "—" if r["save_server_cpu_s"] is None else f"{r['save_server_cpu_s']}, {r['load_server_cpu_s']}"
        )
        commit = "—" if r["commit_seconds"] is None else r["commit_seconds"]
        print(
            f"| {r['impl']} | {r['save_gb_per_s']} | {r['load_gb_per_s']} | {r['save_cpu_s_per_gb']} | "
            f"{r['load_cpu_s_per_gb']} | {server} | {commit} | {r['bytes_copied'] / 2**20:.0f} MiB "
            f"({r['copy_requests']} copies) |"
        )


if __name__ == "__main__":
    main()
