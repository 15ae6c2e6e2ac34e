"""Running a function on several real ranks (processes, gloo) for multi-rank tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., None], world_size: int, store: str, args: tuple[Any, ...]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # anything DCP starts for itself stays on loopback
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Success: skip interpreter teardown, where gloo/c10d threads sometimes abort the process
    # (std::terminate) after the work is done (see tests/ckpt_fsdp.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., None], world_size: int, tmp_path: Path, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; raise if any fails."""
    store = tmp_path / f"pg-store-{os.urandom(4).hex()}"
    mp.start_processes(
        _entry, args=(fn, world_size, str(store), args), nprocs=world_size, join=True, start_method="spawn"
    )
