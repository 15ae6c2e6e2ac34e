"""The training-checkpoint layer: iterations of DCP checkpoints under one URL, and a pointer.

The :class:`Checkpointer` (``checkpointer``) composes four sub-packages, after Orbax's split:

1. ``commit``: the run's folder. Iteration names, the commit protocol, the
   ``latest_checkpoint.txt`` pointer and retention. It imports no torch.
2. ``save``: one save after staging (write every key, commit, retention), in the training
   process or in the background one of an asynchronous save.
3. ``load``: one load (decide what to read, check every key, read, agree across ranks).
4. ``tiers``: a local tier every save commits to first, and the drain to the durable one.

Beside them: ``state`` (modules, optimizers and dicts to DCP state dicts and back), ``options``
(the Checkpointer's grouped options), ``events`` and ``collectives`` (the few cross-rank steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcp_fsspec.checkpoint.checkpointer import Checkpointer

__all__ = ["Checkpointer"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the tools that only list and delete (``ls``, ``prune``, ``cp``) use
    # ``commit`` and ``layout`` without loading torch, which the Checkpointer needs.
    if name == "Checkpointer":
        from dcp_fsspec.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
