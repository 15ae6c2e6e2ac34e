"""A process and every process it started, even those in sessions of their own.

torchrun starts each worker in a new session, so signalling torchrun's process group misses
them. These helpers find descendants through /proc's parent links and signal them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid``, children before their own children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found.extend(below)
        todo.extend(below)
    return found


def signal_tree(pid: int, sig: signal.Signals, tree: list[int] | None = None) -> list[int]:
    """Send ``sig`` to ``pid`` and its descendants (or to ``tree``, found earlier); return them.

    Descendants are found before any is signalled: a dying parent would leave them to init.
    """
    tree = [*descendants(pid), pid] if tree is None else tree
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, sig)
    return tree
