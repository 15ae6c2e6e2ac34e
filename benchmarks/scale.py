"""At a thousand ranks and more, simulated on one machine: a save's coordinator and one rank's load.

``python -m benchmarks.scale [--ranks 1024,4096,8192] [--models 7b,70b] [--shard-group 256]
[--impls torch,ours] [--timeout 1200]``

No tensor is allocated. Each rank's ``SavePlan`` is built as DCP's ``DefaultSavePlanner`` builds
it for FSDP2: every parameter of a llama-like layout sharded on dim 0 over N ranks (one
``WriteItem`` per parameter with the rank's chunk), AdamW's ``exp_avg`` and ``exp_avg_sq``
sharded the same way, its ``step`` a scalar every rank holds, and the param groups as objects.
With ``--shard-group G`` the layout is HSDP: FSDP over each group of G ranks, the N / G groups
replicas of each other. Every rank still sends its plan, but DCP keeps each replicated item
once, so ``.metadata`` holds G chunks a tensor whatever N is.
Those plans then go through what a save's coordinator runs:

1. DCP's global planning (``DefaultSavePlanner.create_global_plan``), which every writer shares;
2. the writer's ``prepare_global_plan``;
3. the writer's ``finish`` with each rank's ``WriteResult`` s (as ``write_data`` returns them),
   which writes ``.metadata`` to a local temporary folder.

The data files are then made as sparse files of the sizes the records need. A fresh process
plays one rank's load: the reader's ``read_metadata``, then its preflight: DCP's local load plan
(``DefaultLoadPlanner``, over stand-ins of the rank's shards), then the reader's
``prepare_local_plan``. Ours checks there that every file the plan reads is there and long
enough; torch's checks nothing.

Each implementation (ours: ``FsspecStorageWriter``/``FsspecStorageReader``; torch's
``FsspecWriter``/``FsspecReader``) runs each phase in its own two processes, so the peaks are
its own. Per phase: CPU seconds of the process (``time.process_time``) and the peak RSS above
the RSS when the phase began (``/proc/self/clear_refs``). Objects identical on every rank (a
parameter's name, global size and properties, the flattening map) are shared between the
simulated ranks, so the plans take less memory than on a real coordinator, alike for both.
With a shard group, a rank's plan is the very plan of its peer in the first group.

One JSON line per case; at the end the markdown table, and ``<out>/samples.json``. A case whose
memory, extrapolated from the smaller N of its model, would pass ``--max-memory-gib`` is
skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks.procmem import peak_mib, reset_peak, rss_mib

IMPLS = ("torch", "ours")
# A record's bytes beyond its tensor's: torch.save's archive around it (zip headers, data.pkl).
RECORD_OVERHEAD = 1100
F32 = 4


@dataclasses.dataclass(frozen=True)
class Layout:
    """A llama-like decoder: the shapes of its parameters."""

    vocab: int
    dim: int
    layers: int
    kv_dim: int
    ffn: int

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        d, kv, ffn = self.dim, self.kv_dim, self.ffn
        params = [("tok_embeddings.weight", (self.vocab, d))]
        for i in range(self.layers):
            p = f"layers.{i}."
            params += [
                (p + "attention.wq.weight", (d, d)),
                (p + "attention.wk.weight", (kv, d)),
                (p + "attention.wv.weight", (kv, d)),
                (p + "attention.wo.weight", (d, d)),
                (p + "feed_forward.w1.weight", (ffn, d)),
                (p + "feed_forward.w2.weight", (d, ffn)),
                (p + "feed_forward.w3.weight", (ffn, d)),
                (p + "attention_norm.weight", (d,)),
                (p + "ffn_norm.weight", (d,)),
            ]
        return [*params, ("norm.weight", (d,)), ("output.weight", (self.vocab, d))]


LAYOUTS = {
    "7b": Layout(vocab=32000, dim=4096, layers=32, kv_dim=4096, ffn=11008),
    "70b": Layout(vocab=128256, dim=8192, layers=80, kv_dim=1024, ffn=28672),
}


class Shard(torch.Tensor):
    """One rank's dim-0 shard of a tensor, as DCP's load planner sees a DTensor: a tensor of the
    global size, without storage, that names its chunk."""

    _chunk: ChunkStorageMetadata

    @staticmethod
    def __new__(cls, size: torch.Size, chunk: ChunkStorageMetadata) -> Shard:
        shard = torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float32)
        shard._chunk = chunk
        return shard

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"a simulated shard has no data ({func})")


def dim0_chunk(size: tuple[int, ...], ranks: int, rank: int) -> tuple[torch.Size, torch.Size]:
    """FSDP2's shard of ``rank`` (``torch.chunk`` on dim 0): its offsets and sizes."""
    if not size:
        return torch.Size(()), torch.Size(())
    step = math.ceil(size[0] / ranks)
    start = min(rank * step, size[0])
    rows = max(0, min(step, size[0] - start))
    zeros = (0,) * (len(size) - 1)
    return torch.Size((start, *zeros)), torch.Size((rows, *size[1:]))


def param_groups(names: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "foreach": None,
            "maximize": False,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
            "initial_lr": 3e-4,
            "params": names,
        }
    ]


def rank_state(layout: Layout, ranks: int, rank: int) -> dict[str, Any]:
    """The state dict one rank hands DCP: model and optimizer, every tensor a :class:`Shard`."""

    def shard(size: tuple[int, ...]) -> Shard:
        offsets, sizes = dim0_chunk(size, ranks, rank)
        return Shard(torch.Size(size), ChunkStorageMetadata(offsets=offsets, sizes=sizes))

    params = layout.parameters()
    return {
        "model": {name: shard(size) for name, size in params},
        "optim": {
            "state": {
                name: {"exp_avg": shard(size), "exp_avg_sq": shard(size), "step": shard(())}
                for name, size in params
            },
            "param_groups": param_groups([name for name, _ in params]),
        },
    }


@dataclasses.dataclass(frozen=True)
class Entry:
    """One flattened key of the state: what every rank's item for it shares."""

    fqn: str
    size: torch.Size | None  # None: an object (BYTE_IO)
    properties: TensorProperties | None
    nbytes: int  # an object's pickled size


def flat_entries(layout: Layout) -> tuple[list[Entry], dict[str, Any]]:
    """The flattened keys, as DCP's ``flatten_state_dict`` names them, and its map."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict(rank_state(layout, 1, 0))
    properties = TensorProperties(dtype=torch.float32)
    entries = [
        Entry(fqn, value.size(), properties, 0)
        if isinstance(value, Shard)
        else Entry(fqn, None, None, len(pickle.dumps(value)))
        for fqn, value in flat.items()
    ]
    return entries, mappings


def rank_plan(entries: list[Entry], mappings: dict[str, Any], ranks: int, rank: int) -> SavePlan:
    """Rank ``rank``'s local plan, as ``DefaultSavePlanner.create_local_plan`` returns it."""
    items = []
    for e in entries:
        if e.size is None:
            items.append(
                WriteItem(
                    index=MetadataIndex(e.fqn),
                    type=WriteItemType.BYTE_IO,
                    bytes_io_data=BytesIOWriteData(nbytes=e.nbytes),
                )
            )
            continue
        offsets, sizes = dim0_chunk(tuple(e.size), ranks, rank)
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
        items.append(
            WriteItem(
                index=MetadataIndex(e.fqn, offsets),
                type=WriteItemType.SHARD if e.size else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(chunk=chunk, properties=e.properties, size=e.size),
            )
        )
    return SavePlan(items, planner_data=mappings)


def item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return item.bytes_io_data.nbytes
    return math.prod(item.tensor_data.chunk.sizes) * F32


def write_results(impl: str, plans: list[SavePlan]) -> list[list[WriteResult]]:
    """What each rank's ``write_data`` returns for its final plan: one record per item, in
    ``__{rank}_{n}.distcp`` files (torch: one file a rank; ours: up to ``files_per_rank``)."""
    from dcp_fsspec.storage.format.names import data_file_name
    from dcp_fsspec.storage.settings import WriterSettings
    from dcp_fsspec.storage.write.file_plan import split_into_files

    files_per_rank = WriterSettings().files_per_rank
    results = []
    for plan in plans:
        prefix = plan.storage_data.prefix
        files = [plan.items] if impl == "torch" else split_into_files(plan.items, files_per_rank)
        rank_results = []
        for n, items in enumerate(files):
            name, offset = data_file_name(prefix, n), 0
            for item in items:
                length = item_bytes(item) + RECORD_OVERHEAD
                info = _StorageInfo(name, offset, length)
                rank_results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
                offset += length
        results.append(rank_results)
    return results


def make_sparse_files(folder: Path, results: list[list[WriteResult]]) -> int:
    """Every data file ``.metadata`` names, of the size its records need and no blocks on disk."""
    ends: dict[str, int] = {}
    for wr in (wr for rank_results in results for wr in rank_results):
        info = wr.storage_data
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in ends.items():
        with open(folder / name, "wb") as f:
            f.truncate(end)
    return len(ends)


def measured(out: dict[str, Any], phase: str, step: Callable[[], Any]) -> Any:
    """Run ``step``; record its CPU seconds and its peak RSS above the RSS it began with."""
    reset_peak()
    before, cpu = rss_mib(), time.process_time()
    result = step()
    out[f"{phase}_cpu_s"] = round(time.process_time() - cpu, 4)
    out[f"{phase}_peak_mib"] = round(max(0.0, peak_mib() - before), 1)
    return result


def writer_of(impl: str, folder: Path) -> Any:
    if impl == "ours":
        from dcp_fsspec import FsspecStorageWriter

        return FsspecStorageWriter(str(folder), None)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(str(folder))


def reader_of(impl: str, folder: Path) -> Any:
    if impl == "ours":
        from dcp_fsspec import FsspecStorageReader

        return FsspecStorageReader(str(folder), None)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(str(folder))


def save_case(impl: str, layout: Layout, ranks: int, group: int, folder: Path) -> dict[str, Any]:
    """A save's coordinator: DCP's global plan, the writer's global plan, its finish."""
    out: dict[str, Any] = {}
    entries, mappings = flat_entries(layout)
    rss, cpu = rss_mib(), time.process_time()
    group_plans = [rank_plan(entries, mappings, group, r) for r in range(group)]
    local_plans = [group_plans[r % group] for r in range(ranks)]
    del group_plans
    out["plans_cpu_s"] = round(time.process_time() - cpu, 2)
    out["plans_mib"] = round(rss_mib() - rss, 1)
    out["items"] = sum(len(p.items) for p in local_plans)
    writer = writer_of(impl, folder)
    writer.reset()
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    planner = DefaultSavePlanner()
    global_plans, metadata = measured(out, "dcp_global", partial(planner.create_global_plan, local_plans))
    del local_plans  # as in dcp.save: the planner keeps the global plans, not the local ones
    final_plans = measured(out, "writer_global", partial(writer.prepare_global_plan, global_plans))
    results = write_results(impl, final_plans)
    measured(out, "finish", partial(writer.finish, metadata, results))
    out["metadata_bytes"] = (folder / ".metadata").stat().st_size
    out["data_files"] = make_sparse_files(folder, results)
    return out


def load_case(impl: str, layout: Layout, ranks: int, group: int, folder: Path) -> dict[str, Any]:
    """One rank's load, up to its first read: ``.metadata``, then the preflight."""
    out: dict[str, Any] = {}
    rank = ranks // 2
    reader = reader_of(impl, folder)
    metadata = measured(out, "read_metadata", reader.read_metadata)
    reader.set_up_storage_reader(metadata, False, rank=rank, use_collectives=True)
    state = rank_state(layout, group, rank % group)
    planner = DefaultLoadPlanner()

    def local_plan() -> Any:
        planner.set_up_planner(state, metadata, False)
        return planner.create_local_plan()

    plan = measured(out, "load_plan", local_plan)
    measured(out, "preflight", partial(reader.prepare_local_plan, plan))
    out["read_items"] = len(plan.items)
    return out


def run_child(args: argparse.Namespace) -> None:
    case = save_case if args.phase == "save" else load_case
    out = case(args.impl, LAYOUTS[args.model], args.n, args.group or args.n, Path(args.folder))
    out[f"{args.phase}_maxrss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(out))


def spawn(
    phase: str, impl: str, model: str, ranks: int, group: int, folder: Path, timeout: float
) -> dict[str, Any]:
    """One phase in a fresh process; its JSON line, or why there is none."""
    command = [sys.executable, "-m", "benchmarks.scale", "--phase", phase, "--impl", impl]
    command += ["--model-one", model, "--n", str(ranks), "--group", str(group), "--folder", str(folder)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"{phase}: over {timeout:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"{phase}: exit {done.returncode}: {last}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def run_case(impl: str, model: str, ranks: int, group: int, timeout: float) -> dict[str, Any]:
    sample: dict[str, Any] = {"model": model, "ranks": ranks, "group": group, "impl": impl}
    folder = Path(tempfile.mkdtemp(prefix=f"scale-{impl}-{model}-{ranks}-"))
    try:
        sample.update(spawn("save", impl, model, ranks, group, folder, timeout))
        if "error" not in sample:
            sample.update(spawn("load", impl, model, ranks, group, folder, timeout))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return sample


def layout_name(s: dict[str, Any]) -> str:
    """``7b`` (FSDP over all ranks) or ``7b HSDP 256`` (FSDP within groups of 256)."""
    group = s.get("group", s["ranks"])
    return s["model"] if group == s["ranks"] else f"{s['model']} HSDP {group}"


def estimated_gib(samples: list[dict[str, Any]], model: str, ranks: int, group: int) -> float | None:
    """The save process's peak at ``ranks``, linear in N from the largest N measured before
    (of the same layout: FSDP over all ranks, or the same shard group)."""
    flat = group == ranks
    done = [
        s
        for s in samples
        if s["model"] == model
        and "save_maxrss_mib" in s
        and s["ranks"] < ranks
        and (s.get("group", s["ranks"]) == s["ranks"] if flat else s.get("group") == group)
    ]
    if not done:
        return None
    last = max(done, key=lambda s: (s["ranks"], s["save_maxrss_mib"]))
    return last["save_maxrss_mib"] / 1024 * ranks / last["ranks"]


def table(samples: list[dict[str, Any]]) -> str:
    """The markdown table: one row per model, N and implementation."""
    rows = [
        "| model · N | impl | items | DCP global plan CPU s / +MiB | writer global plan CPU s | "
        "finish CPU s / +MiB | `.metadata` MB | read_metadata CPU s / +MiB | ÷ torch's | "
        "rank preflight CPU ms: DCP plan + reader |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    torch_read = {
        (layout_name(s), s["ranks"]): s.get("read_metadata_cpu_s") for s in samples if s["impl"] == "torch"
    }
    for s in samples:
        head = f"| {layout_name(s)} · {s['ranks']} | {s['impl']} |"
        if "error" in s or "skipped" in s:
            rows.append(f"{head} {s.get('error') or s['skipped']} |||||||")
            continue
        base = torch_read.get((layout_name(s), s["ranks"]))
        ratio = f"{s['read_metadata_cpu_s'] / base:.2f}×" if base else "–"
        rows.append(
            f"{head} {s['items']:,} | {s['dcp_global_cpu_s']:.2f} / {s['dcp_global_peak_mib']:.0f} | "
            f"{s['writer_global_cpu_s']:.3f} | {s['finish_cpu_s']:.2f} / {s['finish_peak_mib']:.0f} | "
            f"{s['metadata_bytes'] / 1e6:.1f} | {s['read_metadata_cpu_s']:.2f} / "
            f"{s['read_metadata_peak_mib']:.0f} | {ratio} | "
            f"{s['load_plan_cpu_s'] * 1e3:.0f} + {s['preflight_cpu_s'] * 1e3:.0f} |"
        )
    return "\n".join(rows)


# Chart lines: FSDP over all ranks solid, HSDP dashed; 7B circles, 70B squares.
STYLES = {"7b": "-o", "70b": "-s", "7b HSDP 256": "--o", "70b HSDP 256": "--s"}


def coordinator_cpu_s(s: dict[str, Any]) -> float:
    return s["dcp_global_cpu_s"] + s["writer_global_cpu_s"] + s["finish_cpu_s"]


def draw_chart(samples: list[dict[str, Any]], path: Path) -> bool:
    """Coordinator CPU and ``.metadata`` reading against N, per model and implementation, as an
    SVG; False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [s for s in samples if "read_metadata_cpu_s" in s]
    panels = [
        ("save's coordinator CPU s (DCP plan + writer)", coordinator_cpu_s),
        ("one rank's read_metadata CPU s", lambda s: s["read_metadata_cpu_s"]),
        ("save's peak RSS GiB", lambda s: s["save_maxrss_mib"] / 1024),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (title, value) in zip(axes, panels):
        for layout in sorted({layout_name(s) for s in done}):
            for impl, color in (("ours", "#1f6fb4"), ("torch", "#8c8c8c")):
                points = sorted(
                    (s["ranks"], value(s)) for s in done if (layout_name(s), s["impl"]) == (layout, impl)
                )
                if points:
                    ax.plot(*zip(*points), STYLES.get(layout, "-."), color=color, label=f"{impl}, {layout}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    plt.rcParams["svg.hashsalt"] = "scale"
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return True


def run_all(args: argparse.Namespace) -> None:
    samples: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for ranks in sorted(int(n) for n in args.ranks.split(",")):
            group = args.shard_group or ranks
            if ranks % group:
                sys.exit(f"--shard-group {group} does not divide {ranks} ranks into whole replicas")
            for impl in args.impls.split(","):
                estimate = estimated_gib(samples, model, ranks, group)
                limit = min(args.max_memory_gib, available_gib() * 0.8)
                if estimate is not None and estimate > limit:
                    sample = {"model": model, "ranks": ranks, "group": group, "impl": impl}
                    sample["skipped"] = f"skipped: ~{estimate:.0f} GiB expected, {limit:.0f} allowed"
                else:
                    sample = run_case(impl, model, ranks, group, args.timeout)
                print(json.dumps(sample), flush=True)
                samples.append(sample)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "samples.json").write_text(json.dumps({"argv": sys.argv, "samples": samples}, indent=1))
    (out / "results.md").write_text(table(samples) + "\n")
    print(table(samples))
    chart = out / "scale.svg"
    print(f"chart: {chart}" if draw_chart(samples, chart) else "no chart: matplotlib is not installed")


def chart_only(files: list[str], path: Path) -> None:
    """Draw the chart of one or more saved runs (their ``samples.json``)."""
    samples = [s for f in files for s in json.loads(Path(f).read_text())["samples"]]
    if not draw_chart(samples, path):
        sys.exit("no chart: matplotlib is not installed")
    print(f"chart: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1024,4096,8192", help="comma-separated rank counts")
    parser.add_argument("--models", "--model", default="7b", help="comma-separated: 7b, 70b")
    parser.add_argument(
        "--shard-group", type=int, default=0, help="HSDP: FSDP within groups of this many ranks (0: all)"
    )
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated: torch, ours")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per phase process")
    parser.add_argument("--max-memory-gib", type=float, default=16, help="skip cases expected above")
    parser.add_argument("--out", default="benchmarks/results/scale")
    parser.add_argument(
        "--chart", nargs="+", metavar="SAMPLES", help="only draw <out>/scale.svg from samples.json files"
    )
    parser.add_argument("--phase", choices=("save", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--model-one", dest="model", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.chart:
        chart_only(args.chart, Path(args.out) / "scale.svg")
    elif args.phase:
        run_child(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
