"""The safetensors export and import: time and peak memory, ours against torch's.

``python -m benchmarks.safetensors_export --size-gib 4`` saves a float32 state of that size
(64 MiB tensors) and measures, each case in a fresh child process:

* ``torch-consolidate``: torch's HF consolidation (``consolidate_safetensors_files``) of the
  state saved with torch's ``HuggingFaceStorageWriter``, local → local.
* ``torch-consolidate+fsync``: the same, then an fsync of each file it wrote and of the folder:
  the durability our export gives (it fsyncs; torch's consolidation does not).
* ``... local->shm`` (``--shm``): torch's consolidation and our export with the output on
  /dev/shm (tmpfs), so no disk bounds the write; each output is removed after its case.
* ``ours local->local``, ``ours local->s3``, ``ours s3->s3``: ``export_safetensors``.
* ``save s3``: our plain ``dcp.save`` of the same state to S3, for comparison.
* ``import ours`` and ``import torch``: ``dcp.load`` of the exported folder on local disk with
  ``SafetensorsStorageReader`` and with torch's ``HuggingFaceStorageReader``.
* ``checkpointer``: the training thread's time in ``Checkpointer.save`` (async), with and
  without a :class:`~dcp_fsspec.tools.safetensors.on_save.SafetensorsExport` on ``on_event``.

S3 is moto in this process by default (``--server``, ``--s3-endpoint``: see benchmarks/run.py).
Each case prints one JSON line (``peak_extra_mib``: the child's peak RSS above its RSS before
the case, the state excluded); a markdown table closes the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks.procmem import peak_mib, reset_peak, rss_mib
from benchmarks.run import add_server_arguments, drop_page_cache, git_revision, start_server

MiB = 1024 * 1024
_TENSOR_MIB = 64


def make_state(size_gib: float) -> dict[str, torch.Tensor]:
    """Float32 tensors of 64 MiB (fewer bytes for the last), ``size_gib`` in all."""
    total = int(size_gib * 1024 * MiB)
    gen = torch.Generator().manual_seed(0)
    state, i = {}, 0
    while total > 0:
        n = min(total, _TENSOR_MIB * MiB)
        state[f"layers.{i}.weight"] = torch.randn(n // 4 // 1024, 1024, generator=gen)
        total -= n
        i += 1
    return state


# --- the cases, each run in a child process ------------------------------------------------------


def _measured(run: Any) -> dict[str, Any]:
    reset_peak()
    before = rss_mib()
    t0 = time.perf_counter()
    run()
    return {"seconds": round(time.perf_counter() - t0, 3), "peak_extra_mib": round(peak_mib() - before, 1)}


def _case_export(c: dict[str, Any]) -> dict[str, Any]:
    from dcp_fsspec.tools.safetensors.export import export_safetensors

    return _measured(
        lambda: export_safetensors(c["src"], c["out"], c["src_options"], c["out_options"], overwrite=True)
    )


def _case_consolidate(c: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    mapping = dict.fromkeys(c["fqns"], 1)
    os.makedirs(c["out"], exist_ok=True)  # torch's consolidation writes into an existing folder

    def run() -> None:
        consolidate_safetensors_files(c["src"], c["out"], mapping, num_threads=c["threads"])
        if c.get("fsync"):
            _fsync_tree(c["out"])

    return _measured(run)


def _fsync_tree(folder: str) -> None:
    """fsync every file in ``folder``, then the folder: what our export does before it returns."""
    for name in sorted(os.listdir(folder)):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _case_save(c: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from dcp_fsspec.storage.write.writer import FsspecStorageWriter

    state = make_state(c["size_gib"])
    return _measured(
        lambda: dcp.save(
            state, storage_writer=FsspecStorageWriter(c["out"], storage_options=c["out_options"])
        )
    )


def _case_import(c: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from dcp_fsspec.storage.read.safetensors_reader import SafetensorsStorageReader

    state = {k: torch.empty_like(v) for k, v in make_state(c["size_gib"]).items()}
    reader = SafetensorsStorageReader(c["src"]) if c["impl"] == "ours" else HuggingFaceStorageReader(c["src"])
    return _measured(lambda: dcp.load(state, storage_reader=reader))


def _case_checkpointer(c: dict[str, Any]) -> dict[str, Any]:
    from torch import nn

    from dcp_fsspec import Checkpointer
    from dcp_fsspec.tools.safetensors.on_save import SafetensorsExport

    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(max(1, int(c["size_gib"] * 256)))])
    export = (
        SafetensorsExport(c["out"] + "/step-{iteration}", dtype=torch.bfloat16) if c["with_export"] else None
    )
    saves = []
    with Checkpointer(c["src"], async_mode="async_with_pinned_mem", keep_last_n=3, on_event=export) as ckpt:
        for iteration in range(1, 6):
            model(torch.randn(64, 1024)).sum().backward()
            t0 = time.perf_counter()
            ckpt.save(iteration, model=model)
            saves.append(time.perf_counter() - t0)
    if export is not None:
        export.close()
    return {
        "save_seconds_median": round(statistics.median(saves[1:]), 4),
        "saves": [round(s, 4) for s in saves],
    }


_CASES = {
    "export": _case_export,
    "consolidate": _case_consolidate,
    "save": _case_save,
    "import": _case_import,
    "checkpointer": _case_checkpointer,
}


def _child(case: dict[str, Any]) -> dict[str, Any]:
    env = os.environ.copy()
    if case.get("code"):  # another checkout's dcp_fsspec and benchmarks, e.g. the commit before a change
        env["PYTHONPATH"] = case["code"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.safetensors_export", "--child", json.dumps(case)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=case.get("code") or None,
    )
    if done.returncode != 0:
        raise RuntimeError(f"case {case['kind']} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- the run ----------------------------------------------------------------------------------


def _setup(root: str, size_gib: float, s3: dict[str, Any]) -> dict[str, Any]:
    """The state saved three ways: ours on local disk and on S3, torch's HF writer on local disk."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from dcp_fsspec.storage.write.writer import FsspecStorageWriter

    state = make_state(size_gib)
    paths: dict[str, Any] = {
        "ours": os.path.join(root, "dcp"),
        "torch": os.path.join(root, "torch-hf"),
        "s3": s3["url"] + "/dcp",
    }
    dcp.save(state, storage_writer=FsspecStorageWriter(paths["ours"]))
    if s3["url"]:
        dcp.save(state, storage_writer=FsspecStorageWriter(paths["s3"], storage_options=s3["options"]))
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(paths["torch"], save_distributed=True))
    paths["fqns"] = list(state)
    return paths


def _plan(
    root: str, size_gib: float, s3: dict[str, Any], paths: dict[str, Any], threads: int
) -> list[tuple[str, dict[str, Any]]]:
    base = {"size_gib": size_gib, "src_options": None, "out_options": None}
    local_out = os.path.join(root, "hf-ours")
    consolidate = {
        **base,
        "kind": "consolidate",
        "src": paths["torch"],
        "fqns": paths["fqns"],
        "threads": threads,
    }
    return [
        ("torch-consolidate local->local", {**consolidate, "out": os.path.join(root, "hf-torch")}),
        (
            "torch-consolidate+fsync local->local",
            {**consolidate, "out": os.path.join(root, "hf-torch-fsync"), "fsync": True},
        ),
        ("ours local->local", {**base, "kind": "export", "src": paths["ours"], "out": local_out}),
        (
            "ours local->s3",
            {
                **base,
                "kind": "export",
                "src": paths["ours"],
                "out": s3["url"] + "/hf-a",
                "out_options": s3["options"],
            },
        ),
        (
            "ours s3->s3",
            {
                **base,
                "kind": "export",
                "src": paths["s3"],
                "out": s3["url"] + "/hf-b",
                "src_options": s3["options"],
                "out_options": s3["options"],
            },
        ),
        ("save s3", {**base, "kind": "save", "out": s3["url"] + "/save", "out_options": s3["options"]}),
        ("import ours", {**base, "kind": "import", "impl": "ours", "src": local_out}),
        ("import torch", {**base, "kind": "import", "impl": "torch", "src": local_out}),
        # The training thread's time only: 1 GiB at most, so that five saves and exports fit the disk.
        (
            "checkpointer without export",
            {
                **base,
                "size_gib": min(size_gib, 1.0),
                "kind": "checkpointer",
                "src": os.path.join(root, "run-a"),
                "out": "",
                "with_export": False,
            },
        ),
        (
            "checkpointer with export",
            {
                **base,
                "size_gib": min(size_gib, 1.0),
                "kind": "checkpointer",
                "src": os.path.join(root, "run-b"),
                "out": os.path.join(root, "hf-run"),
                "with_export": True,
            },
        ),
    ]


def _shm_cases(cases: list[tuple[str, dict[str, Any]]], shm: str) -> list[tuple[str, dict[str, Any]]]:
    """Torch's consolidation and our export again, the output on tmpfs (``shm``) rather than disk."""
    by_label = dict(cases)
    return [
        (
            "torch-consolidate local->shm",
            {**by_label["torch-consolidate local->local"], "out": os.path.join(shm, "hf-torch")},
        ),
        ("ours local->shm", {**by_label["ours local->local"], "out": os.path.join(shm, "hf-ours")}),
    ]


def _is_local(label: str) -> bool:
    return label.endswith(("local->local", "local->shm"))


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--consolidate-threads", type=int, default=8, help="torch's consolidation threads")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--local-only",
        action="store_true",
        help="only torch's consolidation and our export from local disk: no S3 server",
    )
    p.add_argument("--repeats", type=int, default=1, help="rounds of the cases, one after another")
    p.add_argument(
        "--baseline",
        default=None,
        help="a checkout of another commit: its export from local disk runs beside ours in each round",
    )
    p.add_argument(
        "--shm",
        action="store_true",
        help="also torch's consolidation and our export with the output on /dev/shm (tmpfs)",
    )
    p.add_argument(
        "--only",
        default=None,
        help="run only the cases whose label contains this text, e.g. 'local->shm'",
    )
    add_server_arguments(p)
    return p.parse_args()


def main() -> None:
    args = _arguments()
    if args.child is not None:
        case = json.loads(args.child)
        print(json.dumps(_CASES[case["kind"]](case)), flush=True)
        return
    samples: list[dict[str, Any]] = []
    notes: list[str] = []
    root = tempfile.mkdtemp(prefix="safetensors-bench-", dir=args.local_dir or tempfile.gettempdir())
    shm = tempfile.mkdtemp(prefix="safetensors-bench-", dir="/dev/shm") if args.shm else None
    server = None if args.local_only else start_server(args, [int(args.size_gib * 1024)], notes)[0]
    try:
        s3: dict[str, Any] = {"url": "", "options": None}  # no S3 case runs without a server
        if server is not None:
            for name, value in server.environ().items():
                os.environ.setdefault(name, value)
            server.create_bucket("export-bench")
            s3 = {"url": "s3://export-bench", "options": server.storage_options()}
        paths = _setup(root, args.size_gib, s3)
        cases = _plan(root, args.size_gib, s3, paths, args.consolidate_threads)
        if shm is not None:
            cases += _shm_cases(cases, shm)
        if args.local_only:
            cases = [(label, case) for label, case in cases if _is_local(label)]
        if args.baseline:
            code = os.path.abspath(args.baseline)
            cases += [
                (f"{label}, baseline", {**case, "code": code})
                for label, case in list(cases)
                if label.startswith("ours") and _is_local(label)
            ]
        if args.only:
            cases = [(label, case) for label, case in cases if args.only in label]
        samples = _run(cases * args.repeats, root, shm, args.size_gib)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    _table(samples, args.size_gib)
    _medians(samples)
    for note in notes:
        print(note)


def _run(
    cases: list[tuple[str, dict[str, Any]]], root: str, shm: str | None, size_gib: float
) -> list[dict[str, Any]]:
    """Each case in a child process, in order; its sample printed as a JSON line and returned."""
    revision = git_revision()
    samples = []
    for label, case in cases:
        # Each case into an empty output: removing an earlier run's files is not part of it.
        if case["kind"] in ("export", "consolidate") and os.path.isabs(case["out"]):
            shutil.rmtree(case["out"], ignore_errors=True)
        # Each case from a cold page cache with nothing left to write back: an earlier
        # case's dirty pages would otherwise slow whichever runs next.
        os.sync()
        drop_page_cache(root)
        sample = {
            "bench": "safetensors_export",
            "case": label,
            "size_gib": size_gib,
            "load_average": round(os.getloadavg()[0], 2),
            **_child(case),
            "revision": revision,
        }
        print(json.dumps(sample), flush=True)
        samples.append(sample)
        if shm is not None and case.get("out", "").startswith(shm):
            shutil.rmtree(case["out"], ignore_errors=True)  # tmpfs is memory: one output at a time
    return samples


def _table(samples: list[dict[str, Any]], size_gib: float) -> None:
    gb = size_gib * 2**30 / 1e9
    print(f"\n{size_gib} GiB float32\n\n| case | seconds | GB/s | peak extra RSS MiB |\n|---|---|---|---|")
    for s in samples:
        if "seconds" in s:
            print(f"| {s['case']} | {s['seconds']} | {gb / s['seconds']:.2f} | {s['peak_extra_mib']} |")
    for s in samples:
        if "save_seconds_median" in s:
            print(f"| {s['case']}: save() on the training thread, median | {s['save_seconds_median']} | | |")


def _medians(samples: list[dict[str, Any]]) -> None:
    """Each case's median seconds, and torch's consolidation time over it (above 1: faster than torch's)."""
    seconds: dict[str, list[float]] = {}
    for s in samples:
        if "seconds" in s:
            seconds.setdefault(s["case"], []).append(s["seconds"])
    torch_s = {
        out: statistics.median(seconds[f"torch-consolidate {out}"])
        for out in ("local->local", "local->shm")
        if f"torch-consolidate {out}" in seconds
    }
    fsynced = statistics.median(seconds.get("torch-consolidate+fsync local->local", [float("nan")]))
    print(
        "\n| case | runs | median s | torch's consolidation ÷ it | torch's + fsync ÷ it |\n|---|---|---|---|---|"
    )
    for label, values in seconds.items():
        median = statistics.median(values)
        out = next((o for o in torch_s if o in label), None)
        ratio = f"{torch_s[out] / median:.2f}" if out is not None else ""
        durable = f"{fsynced / median:.2f}" if "local->local" in label else ""
        print(f"| {label} | {len(values)} | {median:.2f} | {ratio} | {durable} |")


if __name__ == "__main__":
    main()
