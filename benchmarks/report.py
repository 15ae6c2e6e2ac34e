"""Medians, ratios and the targets, as markdown, from the workers' samples.

A row is (scenario, backend, implementation); "s3 (stock moto GET)" is the S3 backend with
the server answering ranged GETs the way stock moto does (whole object read per request).
Speeds are tensor bytes (10^9 per GB) over the median seconds of the repeats; the other
columns are medians too. Upload/download ratios divide by what the implementation stored.

``python -m benchmarks.report SAMPLES.json`` re-renders a table from a saved run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from benchmarks.impls import FLOOR, OURS

PEERS = ("dcp_fsspec_obstore", "dcp_fsspec_obstore_unsigned", "torch_fsspec", "torch_fs", "s3torchconnector")
SAVE_PHASES = {"save", "memcopy", "local-write", "s3-put"}
LOAD_PHASES = {"load", "memcopy", "local-read", "s3-get"}
RAW_LABEL = {
    "s3": "ceiling: raw s3fs multipart put / ranged GETs",
    "local": "ceiling: raw write+fsync / cold read, files in parallel",
    "memory": "ceiling: one memory copy (torch clone)",
}
STOCK = "s3 (stock moto GET)"
BACKEND_ORDER = ["s3", STOCK, "local", "memory"]
GET_MODES = {
    "both": f"served from the range (rows s3) and as stock moto does (rows {STOCK})",
    "ranges": "served from the range",
    "stock": "as stock moto does (whole object read per GET)",
}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = None
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal"))
        ram = f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        pass
    versions = {}
    for pkg in ("torch", "fsspec", "s3fs", "moto", "s3torchconnector"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram": ram,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        **versions,
    }


@dataclass
class Cell:
    """The medians of one (row, save-or-load) over the repeats."""

    seconds: float
    nbytes: int
    rss: float | None
    cpu: float | None  # user+sys seconds of the worker processes
    server_cpu: float | None  # user+sys seconds of the S3 server meanwhile
    requests: float | None
    up: float | None
    down: float | None
    stored: float | None
    verified: bool | None
    n: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def cpu_per_gb(self) -> float | None:
        return None if self.cpu is None else self.cpu / (self.nbytes / 1e9)

    @property
    def server_cpu_per_gb(self) -> float | None:
        return None if self.server_cpu is None else self.server_cpu / (self.nbytes / 1e9)


def _median(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _server(s: dict[str, Any], field: str) -> float | None:
    ops = s.get("server")
    if ops is None:
        return None
    if field == "down":
        return sum(c["bytes_out"] for op, c in ops.items() if op.startswith("GetObject"))
    if field == "up":
        return sum(c["bytes_in"] for c in ops.values())
    return sum(c[field] for c in ops.values())


def _cell(samples: list[dict[str, Any]]) -> Cell:
    checks = [s["verified"] for s in samples if "verified" in s]
    return Cell(
        seconds=statistics.median(s["seconds"] for s in samples),
        nbytes=samples[0]["nbytes"],
        rss=_median([s.get("peak_extra_rss_mib") for s in samples]),
        cpu=_median([s.get("cpu_seconds") for s in samples]),
        server_cpu=_median([s.get("server_cpu_seconds") for s in samples]),
        requests=_median([_server(s, "requests") for s in samples]),
        up=_median([_server(s, "up") for s in samples]),
        down=_median([_server(s, "down") for s in samples]),
        stored=_median([s.get("stored_bytes") for s in samples]),
        verified=all(checks) if checks else None,
        n=len(samples),
    )


Key = tuple[str, str, str]  # scenario, backend label, impl


def table_cells(samples: list[dict[str, Any]]) -> dict[tuple[Key, str], Cell]:
    """(scenario, backend label, impl), "save" | "load" → medians."""
    groups: dict[tuple[Key, str], list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        if s.get("kind") != "sample" or s["phase"].startswith("async"):
            continue
        label = STOCK if s.get("moto_get") == "stock" else s["backend"]
        key = (s["scenario"], label, s["impl"])
        if s["phase"] in SAVE_PHASES and s.get("moto_get") != "stock":
            groups[(key, "save")].append(s)
        if s["phase"] in LOAD_PHASES:
            groups[(key, "load")].append(s)
    return {k: _cell(v) for k, v in groups.items()}


# -- formatting ------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _row_label(backend: str, impl: str, meta: dict[str, Any]) -> str:
    if impl == "raw":
        return RAW_LABEL.get(backend.split()[0], "ceiling")
    return meta.get("impls", {}).get(impl, impl)


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render(meta: dict[str, Any], samples: list[dict[str, Any]]) -> str:
    cells = table_cells(samples)
    args = meta.get("args", {})
    m = meta.get("machine", {})
    out = [
        "# dcp_fsspec benchmarks",
        "",
        f"{meta.get('date', '?')} · commit {meta.get('commit')} · {m.get('cpu')} · {m.get('cores')} cores · {m.get('ram')} RAM"
        f" · {m.get('os')} · Python {m.get('python')} · torch {m.get('torch')} · fsspec "
        f"{m.get('fsspec')} · s3fs {m.get('s3fs')} · moto {m.get('moto')} · s3torchconnector "
        f"{m.get('s3torchconnector')}",
        "",
        (
            f"States: realistic, {', '.join(f'{n} MiB' for n in args['sizes'])}"
            if args.get("sizes")
            else f"State: {args.get('size_mib')} MiB realistic"
        )
        + (f", and {args.get('many_small')} small tensors" if args.get("many_small") else "")
        + f"; world size {args.get('world_size')}; medians of {args.get('repeats')} repeats, "
        "each save and each load in a fresh process. GB/s = 10^9 bytes of tensor data per "
        "second. "
        + _server_text(meta.get("s3_server", "moto"))
        + "; the server and the worker share this machine's cores. Client CPU s/GB: user+sys "
        "seconds of the worker process(es) per 10^9 bytes; server CPU s/GB: the S3 server's "
        "meanwhile (where it runs here). "
        "Peak +RSS: the worker's peak resident memory above what it held when the phase started (state or load target already allocated). "
        + (
            f"Server: CompleteMultipartUpload {args.get('moto_complete')}; ranged GETs "
            f"{GET_MODES.get(args.get('moto_get', ''), '?')}."
            if meta.get("s3_server", "moto") == "moto"
            else ""
        ),
    ]
    scenarios = sorted({k[0][0] for k in cells}, key=_scenario_order)
    sweep = _sizes(cells, [s for s in scenarios if s.startswith("state-")], meta)
    if sweep:
        out += [
            "",
            "## Cost per size",
            "",
            "Each cell: GB/s · client CPU s/GB · peak +RSS MiB (medians).",
            "",
            sweep,
        ]
    for scen in scenarios:
        out += ["", f"## {scen}", "", _measurements(cells, scen, meta), "", _ratios(cells, scen)]
    targets = _targets(cells)
    if targets:
        out += [
            "",
            "## Targets",
            "",
            "Set for 1 GiB, 10,000 small tensors and one process; measured here at "
            f"{args.get('size_mib')} MiB, {args.get('many_small') or 'no'} small tensors, "
            f"world size {args.get('world_size')}. S3 loads: range-serving server.",
            "",
            targets,
        ]
    ops = _operations(samples)
    if ops:
        out += ["", "## S3 requests by operation (medians: count, server-side seconds)", "", ops]
    asyncs = _async(samples)
    if asyncs:
        out += ["", "## Async save (dcp_fsspec.Checkpointer)", "", asyncs]
    notes = list(meta.get("notes", []))
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def _server_text(server: str) -> str:
    if server == "moto":
        return "S3 is moto on 127.0.0.1 in the benchmark's own process"
    names = {"ceph": "Ceph RGW", "seaweedfs": "SeaweedFS"}
    return (
        f"S3 is {names[server]} on 127.0.0.1 (tests/servers/)"
        if server in names
        else f"S3 is the server at {server}"
    )


def _scenario_order(scen: str) -> tuple[int, float, str]:
    """``state``, then the sweep's ``state-256M`` … by size, then the rest."""
    if scen == "state":
        return (0, 0, scen)
    if scen.startswith("state-"):
        label = scen.split("-", 1)[1]
        return (1, float(label[:-1]) * (1024 if label.endswith("G") else 1), scen)
    return (2, 0, scen)


def _sizes(cells: dict[tuple[Key, str], Cell], scenarios: list[str], meta: dict[str, Any]) -> str:
    """One row per backend, implementation and phase; one column per size of the sweep."""
    if not scenarios:
        return ""
    rows = []
    for backend, impl in sorted(
        {r for scen in scenarios for r in _rows_of(cells, scen)},
        key=lambda r: (BACKEND_ORDER.index(r[0]), r[1] != OURS, r[1]),
    ):
        for phase in ("save", "load"):
            row = [backend, _row_label(backend, impl, meta), phase]
            for scen in scenarios:
                c = cells.get(((scen, backend, impl), phase))
                row.append(
                    "–" if c is None else f"{c.gbps:.3f} · {_f(c.cpu_per_gb)} · {_f(c.rss, '{:+.0f}')}"
                )
            if any(cell != "–" for cell in row[3:]):
                rows.append(row)
    return _md(["backend", "implementation", "phase", *[s.split("-", 1)[1] for s in scenarios]], rows)


def _rows_of(cells: dict[tuple[Key, str], Cell], scen: str) -> list[tuple[str, str]]:
    order = [OURS, *PEERS, "raw", FLOOR]
    rows = {(k[0][1], k[0][2]) for k in cells if k[0][0] == scen}
    return sorted(rows, key=lambda r: (BACKEND_ORDER.index(r[0]), order.index(r[1])))


def _pair(sv: Cell | None, ld: Cell | None, field: str, fmt: str = "{:.0f}") -> str:
    return " / ".join(_f(getattr(c, field) if c else None, fmt) for c in (sv, ld))


def _measurements(cells: dict[tuple[Key, str], Cell], scen: str, meta: dict[str, Any]) -> str:
    header = [
        "backend",
        "implementation",
        "save GB/s",
        "load GB/s",
        "save s",
        "load s",
        "uploaded ÷ size",
        "downloaded ÷ size",
        "requests save / load",
        "peak +RSS MiB save / load",
        "client CPU s/GB save / load",
        "server CPU s/GB save / load",
        "bitwise",
    ]
    rows = []
    for backend, impl in _rows_of(cells, scen):
        sv = cells.get(((scen, backend, impl), "save"))
        ld = cells.get(((scen, backend, impl), "load"))
        # The stock-GET rows load what the s3 row's save wrote.
        saved = sv or cells.get(((scen, "s3", impl), "save"))
        any_cell = sv or ld
        size = (saved.stored if saved else None) or (any_cell.nbytes if any_cell else 1)
        rows.append(
            [
                backend,
                _row_label(backend, impl, meta),
                _f(sv.gbps if sv else None, "{:.3f}"),
                _f(ld.gbps if ld else None, "{:.3f}"),
                _f(sv.seconds if sv else None),
                _f(ld.seconds if ld else None),
                _ratio(sv.up / size if sv and sv.up is not None else None),
                _ratio(ld.down / size if ld and ld.down is not None else None),
                _pair(sv, ld, "requests"),
                _pair(sv, ld, "rss"),
                _pair(sv, ld, "cpu_per_gb", "{:.2f}"),
                _pair(sv, ld, "server_cpu_per_gb", "{:.2f}"),
                {True: "ok", False: "MISMATCH", None: "–"}[ld.verified if ld else None],
            ]
        )
    return _md(header, rows)


def _speed(cells: dict[tuple[Key, str], Cell], key: Key, phase: str) -> float | None:
    """GB/s of one phase, or of save+load together for ``phase == "save+load"``."""
    if phase == "save+load":
        sv, ld = cells.get((key, "save")), cells.get((key, "load"))
        if sv is None or ld is None:
            return None
        return sv.nbytes / (sv.seconds + ld.seconds) / 1e9
    c = cells.get((key, phase))
    return c.gbps if c else None


def _ratios(cells: dict[tuple[Key, str], Cell], scen: str) -> str:
    header = ["backend", "phase", "dcp_fsspec GB/s", *[f"÷ {p}" for p in PEERS], "÷ ceiling"]
    rows = []
    backends = sorted({b for b, _ in _rows_of(cells, scen)}, key=BACKEND_ORDER.index)
    phases = ["save", "load"] + (["save+load"] if scen != "state" else [])
    for backend in backends:
        for phase in phases:
            ours = _speed(cells, (scen, backend, OURS), phase)
            if ours is None:
                continue
            row = [backend, phase, f"{ours:.3f}"]
            for peer in (*PEERS, "raw"):
                theirs = _speed(cells, (scen, backend, peer), phase)
                row.append(_ratio(ours / theirs if theirs else None))
            rows.append(row)
    if not rows:
        return "_dcp_fsspec did not run in this scenario; no ratios._"
    return _md(header, rows)


@dataclass
class Target:
    text: str
    measure: Callable[[dict[tuple[Key, str], Cell]], float | None]
    goal: float
    at_most: bool = False
    fmt: str = "{:.2f}×"


def _vs(backend: str, phase: str, peer: str, scen: str = "state") -> Callable[..., float | None]:
    def f(cells: dict[tuple[Key, str], Cell]) -> float | None:
        ours = _speed(cells, (scen, backend, OURS), phase)
        theirs = _speed(cells, (scen, backend, peer), phase)
        return ours / theirs if ours and theirs else None

    return f


def _floor_headroom(backend: str, peer: str) -> Callable[..., float | None]:
    """How far ahead of ``peer`` any storage layer could be: ``peer``'s save+load time over
    DCP's own (:mod:`benchmarks.null_storage`), both on the many-small state."""

    def f(cells: dict[tuple[Key, str], Cell]) -> float | None:
        floor = _speed(cells, ("many-small", "memory", FLOOR), "save+load")
        theirs = _speed(cells, ("many-small", backend, peer), "save+load")
        return floor / theirs if floor and theirs else None

    return f


def _down_ratio(cells: dict[tuple[Key, str], Cell]) -> float | None:
    sv, ld = cells.get((("state", "s3", OURS), "save")), cells.get((("state", "s3", OURS), "load"))
    if not ld or ld.down is None:
        return None
    return ld.down / ((sv.stored if sv and sv.stored else None) or ld.nbytes)


def _load_rss(cells: dict[tuple[Key, str], Cell]) -> float | None:
    ld = cells.get((("state", "s3", OURS), "load"))
    return ld.rss if ld else None


TARGETS = [
    Target("S3 save ≥ 2× torch FsspecWriter", _vs("s3", "save", "torch_fsspec"), 2),
    Target("S3 save ≥ 1.5× s3torchconnector", _vs("s3", "save", "s3torchconnector"), 1.5),
    Target("S3 save ≥ 80 % of raw concurrent put", _vs("s3", "save", "raw"), 0.8),
    Target("S3 load ≥ 10× torch FsspecReader", _vs("s3", "load", "torch_fsspec"), 10),
    Target("S3 load ≥ 1.1× s3torchconnector", _vs("s3", "load", "s3torchconnector"), 1.1),
    Target("S3 load ≥ 80 % of raw concurrent ranged GETs", _vs("s3", "load", "raw"), 0.8),
    Target("S3 load downloads ≤ 1.05× the checkpoint", _down_ratio, 1.05, at_most=True),
    Target("local save ≥ 1.5× torch FileSystemWriter (fsync)", _vs("local", "save", "torch_fs"), 1.5),
    Target("local load ≥ 3× torch FileSystemReader (cold)", _vs("local", "load", "torch_fs"), 3),
    Target("S3 load peak extra RSS ≤ 256 MiB", _load_rss, 256, at_most=True, fmt="{:.0f} MiB"),
    Target(
        "10,000 small: S3 save+load ≥ 3× torch FsspecWriter/Reader",
        _vs("s3", "save+load", "torch_fsspec", "many-small"),
        3,
    ),
    Target(
        "10,000 small: local save+load ≥ 3× torch FileSystemWriter/Reader",
        _vs("local", "save+load", "torch_fs", "many-small"),
        3,
    ),
    Target(
        "10,000 small: the most any storage could be ahead of torch FileSystemWriter/Reader "
        "(DCP's own save+load, no I/O, vs torch's)",
        _floor_headroom("local", "torch_fs"),
        3,
    ),
]


def _targets(cells: dict[tuple[Key, str], Cell]) -> str:
    rows = []
    for t in TARGETS:
        v = t.measure(cells)
        met = (
            "not measured" if v is None else ("yes" if (v <= t.goal if t.at_most else v >= t.goal) else "no")
        )
        rows.append([t.text, "–" if v is None else t.fmt.format(v), met])
    return _md(["target", "measured", "target met?"], rows)


def _operations(samples: list[dict[str, Any]]) -> str:
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        if s.get("kind") == "sample" and s.get("server") is not None:
            label = STOCK if s.get("moto_get") == "stock" else s["backend"]
            groups[(s["scenario"], label, s["impl"], s["phase"])].append(s)
    rows = []
    state_first = sorted(groups.items(), key=lambda g: (g[0][0] != "state", g[0]))
    for (scen, backend, impl, phase), ss in state_first:
        ops = sorted({op for s in ss for op in s["server"]})
        parts = []
        for op in ops:
            n = _median([s["server"].get(op, {}).get("requests", 0) for s in ss])
            sec = _median([s["server"].get(op, {}).get("seconds", 0) for s in ss])
            parts.append(f"{op} {n:.0f} ({sec:.2f} s)")
        rows.append([scen, backend, impl, phase, ", ".join(parts)])
    header = ["scenario", "backend", "implementation", "phase", "operations"]
    return _md(header, rows) if rows else ""


def _async(samples: list[dict[str, Any]]) -> str:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        if s.get("kind") == "sample" and s["phase"].startswith("async:"):
            groups[(s["backend"], s["phase"].split(":", 1)[1])].append(s)
    rows = []
    for backend in sorted({b for b, _ in groups}):
        sync = groups.get((backend, "disabled"), [])
        asy = groups.get((backend, "async_with_pinned_mem"), [])
        if not sync or not asy:
            continue
        s_sec = statistics.median(s["seconds"] for s in sync)
        blocked = statistics.median(s["seconds"] for s in asy)
        total = statistics.median(s["total_seconds"] for s in asy)
        later = [s["later_seconds"] for s in asy if "later_seconds" in s]
        copy = [s["copy_seconds"] for s in asy if "copy_seconds" in s]
        later_s = statistics.median(later) if later else None
        copy_s = statistics.median(copy) if copy else None
        rows.append(
            [
                backend,
                f"{s_sec:.2f}",
                f"{blocked:.2f}",
                f"{total:.2f}",
                _f(later_s, "{:.2f}"),
                _f(copy_s, "{:.2f}"),
                f"{(later_s if later_s is not None else blocked) / s_sec:.0%}",
                f"{later_s / copy_s:.2f}×" if later_s and copy_s else "–",
            ]
        )
    header = [
        "backend",
        "sync save s",
        "first async save() blocks s",
        "first until done s",
        "later save() blocks s",
        "one copy_ of the state s",
        "later ÷ sync",
        "later ÷ one copy",
    ]
    return _md(header, rows) if rows else ""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n")[0])
    p.add_argument("samples", help="a samples.json written by benchmarks.run")
    args = p.parse_args(argv)
    with open(args.samples) as f:
        data = json.load(f)
    print(render(data["meta"], data["samples"]))


if __name__ == "__main__":
    main()
