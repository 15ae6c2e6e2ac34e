"""Tensors handed to a process group: on which device, and when its threads let go of them.

Messages between ranks (the checkpointer's decisions, the cooperative reader's bytes) travel in
tensors. This module says where they must live for a group's backend, and waits until gloo's
worker threads no longer hold them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

# How long to wait for a group's threads to let go of a message's tensors. They do so right
# after the collective completes; the bound only keeps a stalled thread from stalling us too.
_RELEASE_TIMEOUT_S = 5.0


def device_for(group: dist.ProcessGroup | None) -> torch.device:
    """CPU where the group's backend carries CPU tensors (gloo), else the current accelerator."""
    backend = str(dist.get_backend(group))
    if backend == "gloo" or "cpu:" in backend:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.get_device_module(accelerator.type).current_device())


def wait_until_released(tensors: list[torch.Tensor]) -> None:
    """Return once nothing but this process's Python objects holds the CPU ``tensors``.

    Gloo's worker threads drop their references just after a collective completes. A thread
    that drops a tensor Python also holds takes the GIL to do so. A program that destroys the
    group while holding the GIL (a DDP model freed after ``destroy_process_group``) joins those
    threads, and would hang at exit if one were still dropping the last message.
    """
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while time.monotonic() < deadline and any(t.device.type == "cpu" and t._use_count() > 1 for t in tensors):
        time.sleep(0.0001)  # lets the thread take the GIL
