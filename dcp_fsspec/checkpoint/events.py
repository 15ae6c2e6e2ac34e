"""What a save or load moved, reported as one log line and to optional callbacks.

Training loops and experiment trackers get a :class:`CheckpointEvent` per save (at its start and
once it is committed) and per load, with the bytes this rank moved and how long it took. With a
local tier, ``save_end`` is the local commit and ``drain_end`` the durable copy's (or its failure).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dcp_fsspec.storage.transport.units import human_bytes, human_rate

logger = logging.getLogger("dcp_fsspec.checkpoint")


@dataclass(frozen=True)
class CheckpointEvent:
    """One save or load, as seen by this rank.

    Attributes:
        kind: ``"save_start"``, ``"save_end"``, ``"load_end"`` or ``"drain_end"``.
        iteration: the training iteration saved, resumed or drained.
        url: the iteration folder.
        keys: the keys saved or loaded.
        nbytes: tensor bytes this rank saved or loaded (its shards only); for ``drain_end``, the
            file bytes copied to the durable tier.
        seconds: wall time; for an asynchronous save, from ``save()`` until its commit was seen.
        tier: ``"local"`` or ``"durable"`` with a local tier (``local_dirname``), else ``None``.
        error: ``drain_end`` only: why the durable copy failed (``None``: it is committed).
        written_bytes: ``save_end`` only: the record bytes this rank wrote to storage (after
            compression, if any); ``None`` for the other events.
        referenced_bytes: ``save_end`` only: the record bytes an incremental save did not write
            again, because its ``.metadata`` refers to them in an older iteration.
    """

    kind: str
    iteration: int
    url: str
    keys: tuple[str, ...]
    nbytes: int
    seconds: float = 0.0
    tier: str | None = None
    error: str | None = None
    written_bytes: int | None = None
    referenced_bytes: int = 0

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
    """Log ``event`` (ends only; a failed drain is the caller's warning) and hand it to ``callback``."""
    if event.kind != "save_start" and event.error is None:
        verb = {"save_end": "saved", "drain_end": "drained"}.get(event.kind, "loaded")
        tier = "" if event.tier is None else f" [{event.tier} tier]"
        logger.info(
            "%s %s%s (%s; %s%s) in %s, %s",
            verb,
            event.url,
            tier,
            ", ".join(event.keys),
            human_bytes(event.nbytes),
            _written(event),
            _duration(event.seconds),
            human_rate(event.nbytes, event.seconds),
        )
    if callback is not None:
        callback(event)


def _written(event: CheckpointEvent) -> str:
    """``": 12.0 MiB written, 1.0 GiB referenced"`` for a save that referred to older records, else ``""``."""
    if event.written_bytes is None or not event.referenced_bytes:
        return ""
    return f": {human_bytes(event.written_bytes)} written, {human_bytes(event.referenced_bytes)} referenced"


def _duration(seconds: float) -> str:
    """``0.0042`` → ``"4.2 ms"``, ``12.5`` → ``"12.50 s"``."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
