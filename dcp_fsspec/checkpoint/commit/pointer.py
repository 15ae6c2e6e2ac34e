"""The ``latest_checkpoint.txt`` pointer: reading it, and moving it by compare-and-swap.

The pointer names the newest committed iteration. It is written atomically, and never moves
backwards, even with two writers: each move replaces it only if it still holds what was read.
*How* a store makes that one step (a conditional PUT, a lock on the folder) is the backend's.
Torch-free, for the tools.
"""

from __future__ import annotations

import logging

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.errors import CorruptCheckpointError, StorageError
from dcp_fsspec.storage.backends import Versioned
from dcp_fsspec.storage.format.names import POINTER_NAME
from dcp_fsspec.storage.transport.urls import Location

logger = logging.getLogger(__name__)

# How often a pointer update re-reads and tries again after losing a race to another writer.
_POINTER_ROUNDS = 20


def pointer_url(root: Location) -> str:
    """The URL of ``root``'s pointer file, for messages."""
    return root.url_of(root.join(POINTER_NAME))


def read_pointer(root: Location) -> int | None:
    """The iteration ``latest_checkpoint.txt`` names, or ``None`` when there is no pointer.

    Trailing whitespace and newlines are accepted.

    Raises:
        CorruptCheckpointError: the pointer is empty or does not hold an iteration folder name.
        StorageError: the backend failed.
    """
    return parse_pointer(root, read_pointer_file(root).data)


def read_pointer_file(root: Location) -> Versioned:
    """The pointer's bytes (``None`` if absent) and the version the backend compares against."""
    return root.backend.read_versioned(root.join(POINTER_NAME))


def parse_pointer(root: Location, raw: bytes | None) -> int | None:
    """The iteration the pointer's bytes ``raw`` name; ``None`` for no pointer.

    Raises:
        CorruptCheckpointError: ``raw`` is not an iteration folder name (named by the URL).
    """
    if raw is None:
        return None
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        text = repr(raw[:40])
    iteration = layout.parse_iteration(text) if "/" not in text else None
    if iteration is None:
        raise CorruptCheckpointError(
            f"{pointer_url(root)} holds {text[:60]!r}, not an iteration folder name like "
            f"{layout.format_iteration(5)!r}; write the name of a committed iteration into it, or delete "
            "it to start over"
        )
    return iteration


def write_pointer(root: Location, iteration: int) -> bool:
    """Point ``latest_checkpoint.txt`` at ``iteration``, atomically; never move it backwards.

    A compare-and-swap: the pointer is read, and replaced only if it still holds what was read
    (the backend's ``replace_if_unchanged``, inside its ``exclusive`` section: S3 a conditional
    PUT; local disk a lock on the folder; elsewhere a lock in this process). So a writer racing
    another one re-reads and backs off rather than overwriting a newer iteration. A PUT that
    landed although its response was lost (then retried and refused) is recognised on the re-read.

    Returns:
        True if the pointer now names ``iteration``; False if it names a newer one and was left
        alone.

    Raises:
        CorruptCheckpointError: the pointer holds something other than an iteration name.
        StorageError: the backend failed, or other writers kept changing the pointer.
    """
    with root.backend.exclusive(root.path):
        for _ in range(_POINTER_ROUNDS):
            read = read_pointer_file(root)
            current = parse_pointer(root, read.data)
            if current is not None and current > iteration:
                logger.warning(
                    "%s names %s, newer than %s; the pointer does not move backwards",
                    pointer_url(root),
                    layout.format_iteration(current),
                    layout.format_iteration(iteration),
                )
                return False
            if current == iteration or replace_pointer(root, iteration, read):
                return True
    raise StorageError(
        f"cannot move {pointer_url(root)} to {layout.format_iteration(iteration)}: it changed "
        f"{_POINTER_ROUNDS} times while we tried; is another run saving to {root.url}?"
    )


def replace_pointer(root: Location, iteration: int, read: Versioned) -> bool:
    """Point at ``iteration`` if the pointer still holds ``read``; False if another write came
    first. Inside ``exclusive(root)`` where the store has no conditional writes."""
    data = (layout.format_iteration(iteration) + "\n").encode()
    return root.backend.replace_if_unchanged(root.join(POINTER_NAME), data, read)


def move_after_lost_race(root: Location, iteration: int) -> int:
    """Move the pointer to ``iteration`` after a :func:`replace_pointer` that lost a race, by
    the full loop of :func:`write_pointer`; the iteration the pointer names afterwards.

    Raises:
        StorageError: the backend failed, or the pointer disappeared meanwhile.
    """
    if write_pointer(root, iteration):
        return iteration
    latest = read_pointer(root)
    if latest is None:  # pragma: no cover - write_pointer returned False because one is newer
        raise StorageError(f"{pointer_url(root)} disappeared while this save moved it; save again")
    return latest
