"""The few cross-rank steps the checkpointer needs, and their single-process stand-ins.

Rank 0 alone touches shared files (the pointer, the commit record, deletions), so every decision
it takes is broadcast, errors included: all ranks then return the same value or raise the same
exception instead of some of them hanging in the next collective. Control messages go over a
gloo group, so they work whatever the backend of the tensors (and, later, from a background
thread while the default group is busy with training).

Objects travel as pickled bytes in tensors this module owns. Each step returns only once the
group's threads have let go of them, so that a program may destroy the group right after a
save (see :func:`~dcp_fsspec.storage.transport.group_tensors.wait_until_released`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from dcp_fsspec.errors import DcpFsspecError, add_note
from dcp_fsspec.storage.transport.group_tensors import device_for, wait_until_released

T = TypeVar("T")


class Collectives:
    """Rank, world size and cross-rank agreement over one process group (or none).

    Args:
        process_group: the group the checkpoint spans. ``None`` uses the default group when
            ``torch.distributed`` is initialized (through a new gloo group if the default one
            is not gloo, e.g. NCCL), and a single process otherwise.
        alone: this process by itself even inside a process group (a rank saving to, or
            loading from, a local tier only it reads: see :mod:`~dcp_fsspec.checkpoint.tiers.tiered`).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, alone: bool = False) -> None:
        self.distributed = not alone and dist.is_available() and dist.is_initialized()
        self._owned_group: dist.ProcessGroup | None = None
        self.group: dist.ProcessGroup | None = process_group
        if self.distributed and process_group is None and dist.get_backend() != "gloo":
            # Collective: every rank constructs its checkpointer at the same point.
            self._owned_group = dist.new_group(backend="gloo")
            self.group = self._owned_group
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1

    def run_on_rank0(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only; every rank returns its result or raises its exception."""
        outcome: list[Any] = [None, None]
        if self.rank == 0:
            try:
                outcome = [fn(), None]
            except Exception as e:  # carried to the other ranks, then re-raised everywhere
                outcome = [None, e]
        if self.distributed:
            if self.rank == 0 and outcome[1] is not None:
                outcome[1] = _picklable(outcome[1], rank=0)
            outcome = self._broadcast(outcome)
        if outcome[1] is not None:
            raise outcome[1]
        return cast(T, outcome[0])

    def all_gather(self, value: T) -> list[T]:
        """Every rank's ``value``, by rank (``[value]`` in a single process)."""
        if not self.distributed:
            return [value]
        return cast(list[T], self._gather(value))

    def raise_if_any_failed(self, error: Exception | None) -> None:
        """Agree on success: if any rank passes an error, every rank raises one.

        A failing rank re-raises its own exception; the others raise the first failing rank's,
        with a note saying which rank it came from. This is also a barrier.
        """
        if not self.distributed:
            if error is not None:
                raise error
            return
        errors = self._gather(None if error is None else _picklable(error, self.rank))
        if error is not None:
            raise error
        for rank, other in enumerate(errors):
            if other is not None:
                add_note(other, f"(raised on rank {rank})")
                raise other

    def _broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        device = device_for(self.group)
        size = torch.zeros(1, dtype=torch.int64, device=device)
        data = torch.empty(0, dtype=torch.uint8, device=device)
        if self.rank == 0:
            data = _to_bytes(value, device)
            size[0] = data.numel()
        dist.broadcast(size, group=self.group, group_src=0)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(data, group=self.group, group_src=0)
        wait_until_released([size, data])
        return value if self.rank == 0 else _from_bytes(data)

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank."""
        device = device_for(self.group)
        data = _to_bytes(value, device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        wait_until_released([size, *sizes, padded, *gathered])
        return [_from_bytes(g[: int(s.item())]) for g, s in zip(gathered, sizes, strict=True)]

    def close(self) -> None:
        """Destroy the gloo group this object created, if any."""
        if self._owned_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._owned_group)
        self._owned_group = None


def _to_bytes(value: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)


def _from_bytes(data: torch.Tensor) -> Any:
    # The peers are ranks of this job, which run the same code: this is not data from storage.
    return pickle.loads(data.cpu().numpy().tobytes())


def _picklable(error: Exception, rank: int) -> Exception:
    """``error`` itself when it survives pickling, else a DcpFsspecError describing it."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return DcpFsspecError(f"rank {rank} failed: {type(error).__name__}: {error}")
    return error
