"""``inspect``: what a checkpoint holds — keys, entries, dtypes, shapes, sizes — from ``.metadata`` only.

Nothing but the ``.metadata`` files is read. A save_dirname is shown at the iteration its
pointer names; an iteration folder key by key; a single DCP checkpoint as one unnamed key.
Each key shows its totals and its first entries (every one on request). For an incremental
save, the bytes stored split into the key's own and those it refers to, by the checkpoint that
holds them (another iteration, or a sibling folder). A ``.metadata`` is
parsed whole, so the command line refuses one past a number of entries before parsing it all.
It is read into torch-free stand-ins (:mod:`dcp_fsspec.storage.format.metadata_standins`): torch is
not imported.
"""

from __future__ import annotations

import argparse
import heapq
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.storage.format.metadata_file import read_metadata
from dcp_fsspec.storage.format.metadata_standins import (
    BytesStorageMetadata,
    TensorStorageMetadata,
    dtype_name,
)
from dcp_fsspec.storage.format.references import is_reference
from dcp_fsspec.storage.transport.urls import Location, resolve
from dcp_fsspec.tools import _cli, targets
from dcp_fsspec.tools.progress import human_bytes

# What inspect lists of a key by default: the first entries in name order (apart from an
# optimizer's param_groups settings, summarized in one line, of which as many are kept).
FIRST_ENTRIES = 100
# The most entries (or records) of one .metadata the command line parses unless told otherwise.
MAX_ENTRIES = 100_000


@dataclass(frozen=True)
class Entry:
    """One state-dict entry: a tensor (dtype, shape, bytes) or a pickled object (bytes stored)."""

    fqn: str
    kind: str  # "tensor" or "object"
    dtype: str | None
    shape: list[int] | None
    nbytes: int  # tensor: elements × element size; object: bytes stored
    chunks: int  # how many pieces it was saved in (ranks' shards)


@dataclass
class KeySummary:
    """One DCP checkpoint (a Checkpointer key, or the checkpoint itself): totals, and the entries listed."""

    key: str | None
    url: str
    stored_bytes: int  # the sum of the records' lengths in the data files
    own_bytes: int = 0  # of those, in the key's own data files
    referenced_bytes: int = 0  # in other checkpoints' files (an incremental save's references)
    referenced_from: dict[str, int] = field(default_factory=dict)  # the folder holding them → bytes
    entry_count: int = 0  # every entry, listed or not
    tensors: int = 0
    tensor_bytes: int = 0
    param_groups: dict[str, Any] | None = None  # see param_groups()
    entries: list[Entry] = field(default_factory=list)  # all, or the first (FIRST_ENTRIES)


@dataclass
class CheckpointSummary:
    """What ``inspect`` shows."""

    url: str
    kind: str
    iteration: int | None
    keys: list[KeySummary] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The summary in words: a line per key, then a table of its entries."""
        lines = [self.url + ("" if self.iteration is None else f"  (iteration {self.iteration})")]
        for key in self.keys:
            lines += [
                "",
                (
                    f"{'key ' + repr(key.key) + ': ' if key.key else ''}{key.url}  "
                    f"{key.tensors} tensors ({human_bytes(key.tensor_bytes)}), "
                    f"{key.entry_count - key.tensors} objects, {human_bytes(key.stored_bytes)} stored"
                    + _referenced(key)
                ),
            ]
            rows = [("entry", "dtype", "shape", "size", "chunks")]
            for e in key.entries:
                if e.fqn.startswith(_PARAM_GROUPS):
                    continue  # summarized below: one line, not a row per parameter and setting
                shape = "-" if e.shape is None else "(" + ", ".join(map(str, e.shape)) + ")"
                rows.append((e.fqn, e.dtype or "object", shape, _cli.size(e.nbytes), str(e.chunks)))
            lines.append(_cli.table(rows))
            unlisted = key.entry_count - len(key.entries)
            if unlisted:
                lines.append(f"... and {unlisted:,} more entries (--all lists every entry)")
            groups = key.param_groups
            if groups is not None:
                lines.append(
                    f"param_groups: {groups['entries']} entries, the settings of {groups['count']} {groups['of']}: "
                    f"{', '.join(groups['keys'])} (--json --all lists every entry)"
                )
        return lines


def describe(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    trust_checkpoint: bool = False,
    first: int | None = FIRST_ENTRIES,
    max_entries: int | None = None,
) -> CheckpointSummary:
    """Summarize the checkpoint, iteration folder or save_dirname (its latest) at ``url``.

    Args:
        url: a DCP checkpoint, an iteration folder or a save_dirname.
        storage_options: options for the fsspec filesystem.
        trust_checkpoint: unpickle ``.metadata`` in full, whatever classes it names.
        first: list this many entries of each key (see :func:`summarize`); ``None``: every one.
        max_entries: refuse a ``.metadata`` of more entries or records, before parsing it all.

    Raises:
        CheckpointNotFoundError: nothing there, or a save_dirname without a pointer.
        CorruptCheckpointError: a ``.metadata`` cannot be read.
        UsageError: a ``.metadata`` holds more than ``max_entries`` entries or records.
        StorageError: the backend failed.
    """
    target = targets.classify(resolve(url, storage_options))
    location = target.location  # a file of a checkpoint names its folder

    def summary_of(key_location: Location, key: str | None) -> KeySummary:
        return summarize(key_location, key, trust_checkpoint, first=first, max_entries=max_entries)

    if target.kind == "checkpoint":
        return CheckpointSummary(location.url, target.kind, None, [summary_of(location, None)])
    run, iteration = targets.iteration_to_read(target, "inspect")
    _, keys = targets.iteration_keys(run, iteration)
    summary = CheckpointSummary(run.url_of(layout.iteration_path(run, iteration)), target.kind, iteration)
    summary.keys = [summary_of(targets.key_location(run, iteration, key), key) for key in keys]
    return summary


def summarize(
    location: Location,
    key: str | None,
    trust_checkpoint: bool = False,
    *,
    first: int | None = None,
    max_entries: int | None = None,
) -> KeySummary:
    """One DCP checkpoint's totals and entries, from its ``.metadata``.

    The parsed ``.metadata`` is dropped once summarized: what is kept is the totals and the
    entries listed.

    Args:
        first: list only the first this many entries in name order, and as many of an
            optimizer's ``param_groups`` settings; ``None``: every entry.
        max_entries: see :func:`describe`.
    """
    # Only .metadata is read: following a reference to a sibling checkpoint opens nothing.
    metadata = read_metadata(
        location, trust_checkpoint=trust_checkpoint, max_entries=max_entries, references=True, stand_ins=True
    )
    entries = metadata.state_dict_metadata
    objects_stored: dict[str, int] = {}
    summary = KeySummary(key, location.url, 0, entry_count=len(entries), param_groups=param_groups(entries))
    for index, info in (metadata.storage_data or {}).items():
        summary.stored_bytes += info.length
        if is_reference(info.relative_path):
            summary.referenced_bytes += info.length
            holder = next(part for part in info.relative_path.split("/") if part != "..")
            summary.referenced_from[holder] = summary.referenced_from.get(holder, 0) + info.length
        else:
            summary.own_bytes += info.length
        if isinstance(entries.get(index.fqn), BytesStorageMetadata):
            objects_stored[index.fqn] = objects_stored.get(index.fqn, 0) + info.length
    for meta in entries.values():
        if isinstance(meta, TensorStorageMetadata):
            summary.tensors += 1
            summary.tensor_bytes += _tensor_bytes(meta)
    if first is None:
        listed = sorted(entries)
    else:
        listed = sorted(
            heapq.nsmallest(first, (f for f in entries if not f.startswith(_PARAM_GROUPS)))
            + heapq.nsmallest(first, (f for f in entries if f.startswith(_PARAM_GROUPS)))
        )
    summary.entries = [_entry(fqn, entries[fqn], objects_stored) for fqn in listed]
    return summary


def _referenced(key: KeySummary) -> str:
    """How much of a key's stored bytes are its own, and where the rest is; empty when all are."""
    if not key.referenced_bytes:
        return ""
    where = ", ".join(f"{human_bytes(n)} in {holder}" for holder, n in sorted(key.referenced_from.items()))
    return f" ({human_bytes(key.own_bytes)} its own, {human_bytes(key.referenced_bytes)} referenced: {where})"


def _entry(fqn: str, meta: object, objects_stored: dict[str, int]) -> Entry:
    if isinstance(meta, TensorStorageMetadata):
        dtype = dtype_name(meta.properties.dtype)
        return Entry(fqn, "tensor", dtype, list(meta.size), _tensor_bytes(meta), len(meta.chunks))
    return Entry(fqn, "object", None, None, objects_stored.get(fqn, 0), 1)


def _tensor_bytes(meta: TensorStorageMetadata) -> int:
    numel = 1
    for s in meta.size:
        numel *= s
    return numel * meta.properties.dtype.itemsize


_PARAM_GROUPS = "param_groups."


def param_groups(fqns: Iterable[str]) -> dict[str, Any] | None:
    """An optimizer's ``param_groups`` entries in short: how many, for how many parameters (a
    flattened optimizer state dict, ``param_groups.<param>.<setting>``) or groups
    (``param_groups.<i>.<setting>``), and which settings; ``None`` when there are none."""
    owners: set[str] = set()
    keys: set[str] = set()
    count = 0
    for fqn in fqns:
        if fqn.startswith(_PARAM_GROUPS):
            owner, _, setting = fqn[len(_PARAM_GROUPS) :].rpartition(".")
            owners.add(owner)
            keys.add(setting)
            count += 1
    if not count:
        return None
    of = "groups" if all(o.isdigit() for o in owners) else "parameters"
    return {"entries": count, "count": len(owners), "of": of, "keys": sorted(keys)}


# --- the subcommand ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _cli.add_standard_arguments(
        parser, ("url", "a DCP checkpoint, an iteration folder, or a save_dirname (its latest iteration)")
    )
    _cli.add_trust_flag(parser)
    parser.add_argument(
        "--all",
        action="store_true",
        help=f"list every entry (default: the first {FIRST_ENTRIES} of each key, and the totals)",
    )
    parser.add_argument(
        "--max-entries",
        type=_at_least_one,
        default=MAX_ENTRIES,
        metavar="N",
        help=f"refuse a .metadata of more than N entries or records, before parsing it all: the whole "
        f"file is parsed in memory (default: {MAX_ENTRIES:,})",
    )


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def main(args: argparse.Namespace) -> int:
    summary = describe(
        args.url,
        _cli.storage_options(args.storage_options),
        trust_checkpoint=args.trust,
        first=None if args.all else FIRST_ENTRIES,
        max_entries=args.max_entries,
    )
    _cli.report(args, summary.to_dict(), summary.lines())
    return _cli.EXIT_OK
