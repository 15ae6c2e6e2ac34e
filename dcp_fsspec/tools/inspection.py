"""``inspect``: what a checkpoint holds — keys, entries, dtypes, shapes, sizes — from ``.metadata`` only.

Nothing but the ``.metadata`` files is read. A save_dirname is shown at the iteration its
pointer names; an iteration folder key by key; a single DCP checkpoint as one unnamed key.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..checkpoint import layout
from ..storage.decoding import read_metadata
from ..storage.urls import Location, resolve
from . import _cli, targets
from .progress import human_bytes


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
    """One DCP checkpoint (a Checkpointer key, or the checkpoint itself)."""

    key: str | None
    url: str
    stored_bytes: int  # the sum of the records' lengths in the data files
    entries: list[Entry] = field(default_factory=list)

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.kind == "tensor")


@dataclass
class CheckpointSummary:
    """What ``inspect`` shows."""

    url: str
    kind: str
    iteration: int | None
    keys: list[KeySummary] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        for key, summary in zip(doc["keys"], self.keys):
            key["tensor_bytes"] = summary.tensor_bytes
            key["param_groups"] = param_groups(summary.entries)
        return doc

    def lines(self) -> list[str]:
        """The summary in words: a line per key, then a table of its entries."""
        lines = [self.url + ("" if self.iteration is None else f"  (iteration {self.iteration})")]
        for key in self.keys:
            tensors = sum(e.kind == "tensor" for e in key.entries)
            lines += ["", (
                f"{'key ' + repr(key.key) + ': ' if key.key else ''}{key.url}  "
                f"{tensors} tensors ({human_bytes(key.tensor_bytes)}), "
                f"{len(key.entries) - tensors} objects, {human_bytes(key.stored_bytes)} stored"
            )]  # fmt: skip
            rows = [("entry", "dtype", "shape", "size", "chunks")]
            for e in key.entries:
                if e.fqn.startswith(_PARAM_GROUPS):
                    continue  # summarized below: one line, not a row per parameter and setting
                shape = "-" if e.shape is None else "(" + ", ".join(map(str, e.shape)) + ")"
                rows.append((e.fqn, e.dtype or "object", shape, _cli.size(e.nbytes), str(e.chunks)))
            lines.append(_cli.table(rows))
            groups = param_groups(key.entries)
            if groups is not None:
                lines.append(
                    f"param_groups: {groups['entries']} entries, the settings of {groups['count']} {groups['of']}: "
                    f"{', '.join(groups['keys'])} (--json lists every entry)"
                )
        return lines


def describe(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, trust_checkpoint: bool = False
) -> CheckpointSummary:
    """Summarize the checkpoint, iteration folder or save_dirname (its latest) at ``url``.

    Raises:
        CheckpointNotFoundError: nothing there, or a save_dirname without a pointer.
        CorruptCheckpointError: a ``.metadata`` cannot be read.
        StorageError: the backend failed.
    """
    target = targets.classify(resolve(url, storage_options))
    location = target.location  # a file of a checkpoint names its folder
    if target.kind == "checkpoint":
        return CheckpointSummary(location.url, target.kind, None, [summarize(location, None, trust_checkpoint)])
    run, iteration = targets.iteration_to_read(target, "inspect")
    _, keys = targets.iteration_keys(run, iteration)
    summary = CheckpointSummary(run.url_of(layout.iteration_path(run, iteration)), target.kind, iteration)
    summary.keys = [summarize(targets.key_location(run, iteration, key), key, trust_checkpoint) for key in keys]
    return summary


def summarize(location: Location, key: str | None, trust_checkpoint: bool = False) -> KeySummary:
    """One DCP checkpoint's entries, from its ``.metadata`` (unpickled in full with ``trust_checkpoint``)."""
    metadata = read_metadata(location, trust_checkpoint=trust_checkpoint)
    storage = metadata.storage_data or {}
    summary = KeySummary(key, location.url, sum(info.length for info in storage.values()))
    stored_by_fqn: dict[str, int] = {}
    for index, info in storage.items():
        stored_by_fqn[index.fqn] = stored_by_fqn.get(index.fqn, 0) + info.length
    for fqn, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            numel = 1
            for s in meta.size:
                numel *= s
            dtype = meta.properties.dtype
            summary.entries.append(
                Entry(fqn, "tensor", str(dtype).removeprefix("torch."), list(meta.size), numel * dtype.itemsize, len(meta.chunks))
            )
        elif isinstance(meta, BytesStorageMetadata):
            summary.entries.append(Entry(fqn, "object", None, None, stored_by_fqn.get(fqn, 0), 1))
    return summary


_PARAM_GROUPS = "param_groups."


def param_groups(entries: list[Entry]) -> dict[str, Any] | None:
    """An optimizer's ``param_groups`` entries in short: how many, for how many parameters (a
    flattened optimizer state dict, ``param_groups.<param>.<setting>``) or groups
    (``param_groups.<i>.<setting>``), and which settings; ``None`` when there are none."""
    owners: set[str] = set()
    keys: set[str] = set()
    count = 0
    for e in entries:
        if e.fqn.startswith(_PARAM_GROUPS):
            owner, _, setting = e.fqn[len(_PARAM_GROUPS) :].rpartition(".")
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


def main(args: argparse.Namespace) -> int:
    summary = describe(args.url, _cli.storage_options(args.storage_options), trust_checkpoint=args.trust)
    _cli.report(args, summary.to_dict(), summary.lines())
    return _cli.EXIT_OK
