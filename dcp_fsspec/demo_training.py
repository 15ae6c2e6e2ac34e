"""The demo's training: a small MLP trained, checkpointed, stopped and resumed in a fresh process.

:mod:`~dcp_fsspec.demo` holds the command; this module holds the work, which needs torch, so
``dcp-fsspec demo --help`` and its usage errors answer without importing it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from dcp_fsspec.checkpoint import Checkpointer
from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.checkpoint.options import ResumeOptions
from dcp_fsspec.storage.transport.urls import resolve

RESULT_PREFIX = "DEMO-RESULT "  # marks the resumed process's one machine-readable line


@dataclass
class DemoConfig:
    """What the demo trains and where it checkpoints (both processes get the same values)."""

    url: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    steps: int = 300
    every: int = 50
    stop_at: int = 170
    keep_last_n: int = 3
    seed: int = 0


@dataclass
class Run:
    """One training process: the loss at its last step, and its checkpoint timings."""

    last_loss: float = float("nan")
    resumed_from: int = 0
    load_seconds: float = 0.0
    saves: list[tuple[int, float, int]] = field(default_factory=list)  # (iteration, seconds, bytes)


class Trainer:
    """A three-layer MLP fitting a fixed random function, with everything a resume needs."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
        )
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optim, step_size=100, gamma=0.5)
        self.teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(seed + 1))
        self.data = torch.Generator().manual_seed(seed + 2)
        # What the model's state does not cover: the step and the data stream's position.
        self.state: dict[str, Any] = {"step": 0, "data_rng": self.data.get_state()}

    def keys(self) -> dict[str, Any]:
        """The keywords for Checkpointer.save/load."""
        self.state["data_rng"] = self.data.get_state()
        return {"model": self.model, "optim": self.optim, "scheduler": self.scheduler, "trainer": self.state}

    def after_load(self) -> None:
        self.data.set_state(self.state["data_rng"])

    def step(self) -> float:
        x = torch.randn(64, 16, generator=self.data)
        y = torch.sin(x @ self.teacher)
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state["step"] += 1
        return loss.item()


def _train(trainer: Trainer, stop: int, ckpt: Checkpointer | None, cfg: DemoConfig, run: Run) -> None:
    while trainer.state["step"] < stop:
        run.last_loss = trainer.step()
        step = trainer.state["step"]
        if ckpt is not None and (step % cfg.every == 0 or step == cfg.steps):
            start = time.perf_counter()
            ckpt.save(step, **trainer.keys())
            # Measured now: retention may delete this iteration before the table is printed.
            run.saves.append((step, time.perf_counter() - start, _size(cfg, step)))


def train_uninterrupted(cfg: DemoConfig) -> tuple[Trainer, Run]:
    """The reference: every step in one go, no checkpoints."""
    trainer, run = Trainer(cfg.seed), Run()
    _train(trainer, cfg.steps, None, cfg, run)
    return trainer, run


def train_with_checkpoints(cfg: DemoConfig, stop: int, *, new_run: bool = False) -> Run:
    """Resume from ``cfg.url`` if it holds a checkpoint, train to ``stop``, checkpointing.

    ``new_run``: the first process, on an empty ``cfg.url``: nothing to resume is expected, not
    a warning."""
    trainer, run = Trainer(cfg.seed), Run()
    resume = ResumeOptions(missing_ok=new_run)
    with Checkpointer(cfg.url, cfg.storage_options, keep_last_n=cfg.keep_last_n, resume=resume) as ckpt:
        start = time.perf_counter()
        run.resumed_from = ckpt.load(**trainer.keys())
        run.load_seconds = time.perf_counter() - start
        trainer.after_load()
        _train(trainer, stop, ckpt, cfg, run)
    return run


def resume_worker(config_json: str) -> int:
    """The fresh process: resume, finish training, report one JSON line on stdout.

    The configuration comes as JSON on stdin rather than on the command line, so that storage
    credentials do not show in the process list.
    """
    _quiet()
    torch.set_num_threads(1)
    cfg = DemoConfig(**json.loads(config_json))
    run = train_with_checkpoints(cfg, cfg.steps)
    print(RESULT_PREFIX + json.dumps({**asdict(run), "last_loss": run.last_loss.hex()}), flush=True)
    return 0


def _resume_in_fresh_process(cfg: DemoConfig) -> Run:
    command = [sys.executable, "-m", "dcp_fsspec", "demo", "--resume-worker"]
    env = dict(os.environ)  # find this copy of dcp_fsspec even when it is not installed
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        command, input=json.dumps(asdict(cfg)), stdout=subprocess.PIPE, text=True, env=env, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"the resumed process failed (exit code {done.returncode}); its output:\n{done.stdout}"
        )
    doc = json.loads(lines[-1][len(RESULT_PREFIX) :])
    saves = [(int(i), float(s), int(b)) for i, s, b in doc["saves"]]
    return Run(float.fromhex(doc["last_loss"]), doc["resumed_from"], doc["load_seconds"], saves)


def _size(cfg: DemoConfig, iteration: int) -> int:
    """Bytes of one iteration's keys, its commit record left out."""
    root = resolve(cfg.url, cfg.storage_options)
    folder = root.join(layout.format_iteration(iteration))
    sizes = root.fs.du(folder, total=False).items()
    return sum(int(size) for path, size in sizes if not path[len(folder) :].strip("/").startswith("."))


def _table(first: Run, second: Run, kept: Sequence[int]) -> str:
    rows = [("iteration", "saved by", "size", "save", "kept")]
    for who, run in (("first process", first), ("fresh process", second)):
        for iteration, seconds, size in run.saves:
            rows.append(
                (
                    layout.format_iteration(iteration),
                    who,
                    f"{size / 1024:.1f} KiB",
                    f"{seconds * 1000:.0f} ms",
                    "yes" if iteration in kept else "deleted",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _quiet() -> None:
    # DCP warns on every single-process save/load that it assumes a single process, which is
    # exactly what the demo means; the warning would only bury the table.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def run_demo(cfg: DemoConfig, out: Callable[[str], None] = print) -> bool:
    """Run the whole demo against ``cfg.url``; True if the resumed run matched bit for bit."""
    _quiet()
    torch.set_num_threads(1)  # the same arithmetic in both processes, whatever the machine
    keys = sorted(Trainer(cfg.seed).keys())
    out(f"checkpoints: {cfg.url}   keys: {', '.join(keys)}   every {cfg.every} of {cfg.steps} steps")
    start = time.perf_counter()
    reference, reference_run = train_uninterrupted(cfg)
    out(
        f"uninterrupted run: {cfg.steps} steps, final loss {reference_run.last_loss:.6f} ({time.perf_counter() - start:.1f} s)"
    )

    first = train_with_checkpoints(cfg, cfg.stop_at, new_run=True)
    out(f"first process: stopped at step {cfg.stop_at} after {len(first.saves)} checkpoints")
    second = _resume_in_fresh_process(cfg)
    out(
        f"fresh process: resumed from iteration {second.resumed_from} in {second.load_seconds * 1000:.0f} ms, "
        f"trained to step {cfg.steps}, final loss {second.last_loss:.6f}"
    )

    final = Trainer(cfg.seed + 1)  # different initial weights: everything must come from storage
    with Checkpointer(cfg.url, cfg.storage_options) as ckpt:
        iteration = ckpt.load(model=final.model)
        kept = ckpt.committed_iterations()
    same_weights = iteration == cfg.steps and all(
        torch.equal(a, b)
        for a, b in zip(reference.model.state_dict().values(), final.model.state_dict().values())
    )
    same_loss = second.last_loss.hex() == reference_run.last_loss.hex()
    out("")
    out(_table(first, second, kept))
    out("")
    out("A save this small takes the time of its requests (the files, the commit record, the pointer),")
    out("not of its bytes. `make bench` measures throughput, on a 1 GiB checkpoint.")
    out("")
    if same_weights and same_loss:
        out(
            f"resumed training is bit-identical to the uninterrupted run (weights at step {cfg.steps} and final loss)"
        )
        return True
    out(f"MISMATCH: weights identical: {same_weights}, final loss identical: {same_loss}")
    return False
