"""The training-checkpoint layer: iterations of DCP checkpoints under one URL, and a pointer.

Each module owns one piece, after Orbax's split: ``layout`` names the iteration folders and finds
them; ``commit`` decides what makes an iteration committed and moves the
``latest_checkpoint.txt`` pointer atomically; ``retention`` decides which old iterations to
delete; ``state`` turns modules, optimizers, schedulers and dicts into DCP state dicts and back;
``pipeline`` runs one save after staging (prepare, write, commit, retention), in the training
process or in the ``background`` one; ``resume`` decides what a load reads; ``_collectives``
holds the few cross-rank steps; ``checkpointer`` composes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

__all__ = ["Checkpointer"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the tools that only list and delete (``ls``, ``prune``, ``cp``) use
    # ``commit`` and ``layout`` without loading torch, which the Checkpointer needs.
    if name == "Checkpointer":
        from .checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
