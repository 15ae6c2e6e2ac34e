"""What each rank runs for tests/test_control_plane_requests.py: saves, then a resume.

Kept apart from the test module so that a spawned rank imports only this, not pytest and the
test servers: at 16 ranks on two cores, each rank's imports are most of the run.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import fsspec
import torch
import torch.distributed as dist

from dcp_fsspec import Checkpointer

SAVES = 3
KEYS = ("weights", "optim")
# The object a request names when rank 0 marks, through the proxy, where the resume starts.
RESUME_MARK = "the-resume-starts-here"


def state(rank: int, value: float) -> dict[str, dict[str, torch.Tensor]]:
    """Each key a dict of this rank's own tensor: every rank writes a data file per key."""
    return {key: {f"rank{rank}": torch.full((64,), value)} for key in KEYS}


def save_then_resume(rank: int, world_size: int, url: str, options: dict[str, Any]) -> None:
    """``SAVES`` saves keeping one iteration (so retention deletes), then a resume on every rank.

    The resume starts as a restarted job would: with no filesystem (nor its listings) cached
    from the saves. Rank 0 marks the boundary with a request to the proxy between two barriers.
    """
    torch.set_num_threads(1)
    with Checkpointer(url, options, keep_last_n=1) as ckpt:
        for it in range(1, SAVES + 1):
            ckpt.save(it, **state(rank, float(it)))
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    dist.barrier()
    if rank == 0:
        _mark_the_resume(options["client_kwargs"]["endpoint_url"])
    dist.barrier()
    back = state(rank, 0.0)
    with Checkpointer(url, options, keep_last_n=1) as ckpt:
        assert ckpt.load(**back) == SAVES
    assert all(torch.equal(back[key][f"rank{rank}"], torch.full((64,), float(SAVES))) for key in KEYS)


def _mark_the_resume(endpoint_url: str) -> None:
    try:
        urllib.request.urlopen(f"{endpoint_url}/marks/{RESUME_MARK}", timeout=60).close()
    except urllib.error.HTTPError:
        pass  # the store does not know the object; the proxy has seen the request
