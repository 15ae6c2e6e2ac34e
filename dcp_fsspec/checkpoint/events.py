"""What a save or load moved, reported as one log line and to optional callbacks.

Training loops and experiment trackers get a :class:`CheckpointEvent` per save (at its start and
once it is committed) and per load, with the bytes this rank moved and how long it took.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

logger = logging.getLogger("dcp_fsspec.checkpoint")


@dataclass(frozen=True)
class CheckpointEvent:
    """One save or load, as seen by this rank.

    Attributes:
        kind: ``"save_start"``, ``"save_end"`` or ``"load_end"``.
        iteration: the training iteration saved or resumed.
        url: the iteration folder.
        keys: the keys saved or loaded.
        nbytes: tensor bytes this rank saved or loaded (its shards only).
        seconds: wall time; for an asynchronous save, from ``save()`` until its commit was seen.
    """

    kind: str
    iteration: int
    url: str
    keys: tuple[str, ...]
    nbytes: int
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """10^9 bytes per second (0 when no time passed)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


Callback = Callable[[CheckpointEvent], None]


def tensor_nbytes(value: Any) -> int:
    """Bytes of every tensor in a nested state dict (a DTensor counts its local shard)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_nbytes(v) for v in value)
    return 0


def report(event: CheckpointEvent, callback: Callback | None) -> None:
    """Log ``event`` (ends only) and hand it to ``callback``."""
    if event.kind != "save_start":
        verb = "saved" if event.kind == "save_end" else "loaded"
        logger.info(
            "%s %s (%s; %.1f MiB) in %.2f s, %.3f GB/s",
            verb, event.url, ", ".join(event.keys), event.nbytes / 2**20, event.seconds, event.gbps,
        )
    if callback is not None:
        callback(event)
