"""CI: a plain dcp.save and load, and a Checkpointer's, at two gloo ranks of a clean install.

Run by ``torchrun --standalone --nproc-per-node 2 .ci/two_ranks.py FOLDER`` from .ci/clean-install.
torch's plan exchange (gather_object) needs numpy: this fails where the install lacks it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_fsspec import Checkpointer, FsspecStorageReader, FsspecStorageWriter


def main(folder: str) -> None:
    """Save and load both ways; raise on any difference."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tensor = torch.arange(1000, dtype=torch.float32) + rank
    dcp.save({f"w{rank}": tensor, "step": 3}, storage_writer=FsspecStorageWriter(f"{folder}/plain"))
    back: dict[str, Any] = {f"w{rank}": torch.zeros(1000), "step": 0}
    dcp.load(back, storage_reader=FsspecStorageReader(f"{folder}/plain"))
    assert torch.equal(back[f"w{rank}"], tensor) and back["step"] == 3
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with Checkpointer(f"{folder}/ckpt") as ckpt:
        ckpt.save(10, model=model)
    fresh = torch.nn.Linear(8, 4)
    with Checkpointer(f"{folder}/ckpt") as ckpt:
        assert ckpt.load(model=fresh) == 10
    assert torch.equal(fresh.weight, model.weight)
    dist.barrier()
    if rank == 0:
        print("clean install: two gloo ranks save and load")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
