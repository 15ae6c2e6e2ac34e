"""Charts of the benchmark results, for the README and the documentation site.

``python -m benchmarks.plot`` reads ``benchmarks/results/latest.json`` (the figures the tables
state, each section naming its run) and writes one SVG per section into ``docs/images/``.
``--check`` draws them in memory and fails when a committed chart differs, so a chart never
disagrees with its results file. The SVGs are byte-stable: no date, a fixed id salt.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)
from matplotlib.figure import Figure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "latest.json"
IMAGES = ROOT / "docs" / "images"
OURS, THEIRS = "#1f6fb4", "#b0b0b0"
COLORS = {"dcp_fsspec": OURS, "s3torchconnector": "#e08a2c", "torch": "#8c8c8c"}


def _caption(section: dict[str, Any]) -> str:
    """The line under a chart: when, at which commit, with which command."""
    return f"{section['date']}, commit {section['commit']}: {section['command']}"


def _figure(section: dict[str, Any], panels: int) -> tuple[Figure, Any]:
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 4.0))
    fig.suptitle(section["title"], fontsize=12)
    fig.text(0.5, 0.01, _caption(section), ha="center", fontsize=7, color="#555555")
    return fig, axes


def _finish(fig: Figure, ax: Any, columns: int) -> Figure:
    """One legend for the figure, under its title, and the panels laid out below it."""
    fig.legend(
        *ax.get_legend_handles_labels(),
        loc="upper center",
        bbox_to_anchor=(0.5, 0.94),
        ncol=columns,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 0.84))
    return fig


def headline(section: dict[str, Any]) -> Figure:
    """Save and load GB/s, and client CPU s/GB, per implementation at 1 and 2 ranks."""
    fig, axes = _figure(section, 4)
    ranks = section["ranks"]
    impls = section["implementations"]
    width = 0.8 / len(impls)
    panels = [
        ("save_gbps", "save GB/s (higher is better)"),
        ("load_gbps", "load GB/s (higher is better)"),
        ("save_cpu_s_per_gb", "save client CPU s/GB (lower is better)"),
        ("load_cpu_s_per_gb", "load client CPU s/GB (lower is better)"),
    ]
    for ax, (field, label) in zip(axes, panels):
        for i, (name, impl) in enumerate(impls.items()):
            xs = [r + (i - (len(impls) - 1) / 2) * width for r in range(len(ranks))]
            ax.bar(xs, impl[field], width, label=impl["label"], color=COLORS.get(name, THEIRS))
        ax.set_xticks(range(len(ranks)), [f"{r} rank" + ("s" if r > 1 else "") for r in ranks])
        ax.set_title(label, fontsize=9)
    return _finish(fig, axes[0], len(impls))


def cost_per_size(section: dict[str, Any]) -> Figure:
    """GB/s and client CPU s/GB against the checkpoint's size, one line per series."""
    fig, axes = _figure(section, 2)
    sizes = section["sizes_mib"]
    for name, series in section["series"].items():
        style = "-" if "dcp_fsspec" in name else "--"
        color = (
            OURS if "dcp_fsspec" in name and "moto" in name else ("#2ca02c" if "local" in name else "#e08a2c")
        )
        marker = "o" if "save" in name else "s"
        axes[0].plot(sizes, series["gbps"], style, color=color, marker=marker, label=name)
        axes[1].plot(sizes, series["cpu_s_per_gb"], style, color=color, marker=marker, label=name)
    for ax, label in zip(axes, ("GB/s (higher is better)", "client CPU s/GB (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{s} MiB" if s < 1024 else f"{s // 1024} GiB" for s in sizes])
        ax.set_title(label, fontsize=9)
    return _finish(fig, axes[0], 3)


def small(section: dict[str, Any]) -> Figure:
    """Milliseconds per small save and load, ours against torch's, in each setting."""
    fig, axes = _figure(section, 2)
    settings = section["settings"]
    for ax, (phase, label) in zip(axes, ((0, "save ms (lower is better)"), (1, "load ms (lower is better)"))):
        xs = range(len(settings))
        ax.bar(
            [x - 0.2 for x in xs],
            [s["ours_ms"][phase] for s in settings.values()],
            0.4,
            color=OURS,
            label="dcp_fsspec Checkpointer",
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [s["torch_ms"][phase] for s in settings.values()],
            0.4,
            color=THEIRS,
            label="torch, one dcp.save per key + pointer",
        )
        ax.set_xticks(list(xs), [name.replace(" + ", "\n+ ") for name in settings], fontsize=7)
        ax.set_title(label, fontsize=9)
    return _finish(fig, axes[0], 2)


CHARTS: dict[str, tuple[str, Callable[[dict[str, Any]], Figure]]] = {
    "headline": ("throughput.svg", headline),
    "cost_per_size": ("cost_per_size.svg", cost_per_size),
    "small": ("small_checkpoints.svg", small),
}


def render(results: dict[str, Any]) -> dict[str, bytes]:
    """Each chart's file name and SVG bytes."""
    plt.rcParams["svg.hashsalt"] = "dcp-fsspec"
    out: dict[str, bytes] = {}
    for key, (name, draw) in CHARTS.items():
        fig = draw(results[key])
        buffer = io.BytesIO()
        fig.savefig(buffer, format="svg", metadata={"Date": None})
        plt.close(fig)
        out[name] = buffer.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results file (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=IMAGES, help="folder for the SVGs (default: %(default)s)")
    parser.add_argument(
        "--check", action="store_true", help="fail if a committed chart differs from its results"
    )
    args = parser.parse_args(argv)
    charts = render(json.loads(args.results.read_text()))
    stale = [
        name
        for name, svg in charts.items()
        if not (args.out / name).is_file() or (args.out / name).read_bytes() != svg
    ]
    if args.check:
        if stale:
            print(
                f"stale charts in {args.out}: {', '.join(stale)}; run `python -m benchmarks.plot` and commit them",
                file=sys.stderr,
            )
            return 1
        print(f"{len(charts)} charts in {args.out} match {args.results}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, svg in charts.items():
        (args.out / name).write_bytes(svg)
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
