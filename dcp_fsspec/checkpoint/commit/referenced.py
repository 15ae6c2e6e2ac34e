"""Which files of a run its iterations refer to: the references in their keys' ``.metadata``.

A key of an incremental save names the records it did not write again by a path into another
iteration (:mod:`~dcp_fsspec.storage.format.references`). Retention keeps every file a kept iteration refers to,
and ``ls`` shows the bytes an iteration refers to. Reading ``.metadata`` imports torch, so it is
read only for runs that hold incremental saves: a plain run's tools stay torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.checkpoint.commit.at_once import at_once
from dcp_fsspec.checkpoint.commit.commit_record import read_commit_record
from dcp_fsspec.checkpoint.commit.run_listing import Listing
from dcp_fsspec.storage.format.references import is_reference
from dcp_fsspec.storage.transport.urls import Location


def key_references(root: Location, iteration: int, key: str) -> dict[str, int]:
    """The files ``key`` of ``iteration`` refers to (their paths) → the bytes it reads in each.

    Raises:
        CheckpointNotFoundError: the key has no ``.metadata``.
        CorruptCheckpointError: its ``.metadata`` is damaged, or a reference is of no allowed shape.
        StorageError: the backend failed.
    """
    # torch's: only incremental runs pay for importing it.
    from dcp_fsspec.storage.format.metadata_file import read_metadata

    folder = root.at(layout.key_path(root, iteration, key))
    records: dict[tuple[str, int], int] = {}
    for info in (read_metadata(folder).storage_data or {}).values():
        if is_reference(info.relative_path):
            records[(folder.join(info.relative_path), info.offset)] = info.length
    found: dict[str, int] = {}
    for (path, _), length in records.items():
        found[path] = found.get(path, 0) + length
    return found


def may_be_referred_to(listed: Listing, iteration: int) -> bool:
    """Whether other iterations may refer to files of ``iteration``: one of its keys is an
    incremental save's (only those store the content hashes a later save compares with), or the
    listing did not see inside its folder."""
    return bool(listed.incremental_keys(iteration)) or iteration not in listed.read


def referred_files(root: Location, listed: Listing, kept: Iterable[int]) -> frozenset[str]:
    """Every file the ``kept`` iterations refer to, by path: each key's ``.metadata`` read once.

    A kept iteration's keys are those ``listed`` shows finished, or its commit record's where
    the listing did not see inside its folder (an iteration committed since).

    Raises:
        CorruptCheckpointError: a ``.metadata`` or commit record read is damaged.
        StorageError: the backend failed.
    """
    keys = [(i, key) for i in kept for key in _keys(root, listed, i)]
    calls = [partial(key_references, root, i, key) for i, key in keys]
    return frozenset(path for found in at_once(calls, one_by_one=root.answers_locally) for path in found)


def _keys(root: Location, listed: Listing, iteration: int) -> list[str]:
    if iteration in listed.read:
        return sorted(key for i, key in listed.finished if i == iteration)
    record = read_commit_record(root, iteration)
    return [] if record is None else list(record.keys)


def held_by(root: Location, iteration: int, files: Iterable[str]) -> set[str]:
    """Those of ``files`` that lie in ``iteration``'s folder."""
    prefix = layout.iteration_path(root, iteration).rstrip("/") + "/"
    return {path for path in files if path.startswith(prefix)}
