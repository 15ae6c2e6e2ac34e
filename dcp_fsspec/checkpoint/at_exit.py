"""Finishing open Checkpointers when the interpreter exits, so a last background save is not lost.

The hook is registered with ``atexit`` when the first background saver or drain starts. It then
runs before ``multiprocessing``'s own exit handler (handlers run last-registered first), which
would terminate the background process mid-save. It holds the checkpointers weakly.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol

# How long the interpreter's exit waits for an asynchronous save in flight.
EXIT_WAIT_SECONDS = 600.0


class Finishable(Protocol):
    """What the hook finishes: a Checkpointer."""

    def _finish_at_exit(self, timeout: float) -> None: ...


class ExitHook:
    """Finishes every registered checkpointer at exit, each within ``timeout`` seconds."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._open: weakref.WeakSet[Finishable] = weakref.WeakSet()
        self._registered = False

    def register(self, checkpointer: Finishable) -> None:
        """Finish ``checkpointer`` at exit unless it is gone by then."""
        self._open.add(checkpointer)
        if not self._registered:
            atexit.register(self.run)
            self._registered = True

    def run(self) -> None:
        for checkpointer in list(self._open):
            checkpointer._finish_at_exit(self.timeout)


EXIT_HOOK = ExitHook(EXIT_WAIT_SECONDS)
