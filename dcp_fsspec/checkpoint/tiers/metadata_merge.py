"""One global DCP ``.metadata`` from the ``.metadata`` each rank wrote for itself alone.

With per-node local disks (:mod:`~dcp_fsspec.checkpoint.tiers.tiered`) each rank saves its own share of every key as a
checkpoint of its own (``dcp.save`` without collectives): its ``.metadata`` describes the
chunks this rank wrote, replicated entries included, in data files named ``__0_*``. The drain
uploads each rank's data files as ``__{rank}_*`` and rank 0 turns the ranks' ``.metadata`` into
the one a direct save of all ranks would have written: every chunk once (a replicated tensor,
or a non-tensor entry, every rank wrote whole, is kept from the lowest rank, as DCP's own dedup
keeps it), each pointing at the file its rank uploaded. The durable copy is then a plain
checkpoint, read by any DCP reader.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from dcp_fsspec.storage.format.names import CONTENT_HASHES_NAME, content_hashes_name


def merge_metadata(
    parts: Sequence[tuple[int, Metadata]],
    *,
    rename: Callable[[str, int], str],
    save_id: str,
    checkpoint_id: str,
) -> Metadata:
    """The global metadata of the ranks' own ``parts`` (``(rank, metadata)``, in any order).

    Args:
        parts: each rank's ``.metadata`` of one key.
        rename: the name a rank's data file (as its ``.metadata`` names it) has in the merged
            checkpoint.
        save_id: the token the merged ``.metadata`` carries (the commit checks it).
        checkpoint_id: where the merged checkpoint lives (DCP's ``storage_meta``).

    Raises:
        ValueError: two ranks wrote chunks of one entry at the same offsets but of other sizes:
            not replicas of one shard, so no global checkpoint holds both; or an entry is a
            tensor on one rank and not on another.
    """
    entries: dict[str, STORAGE_TYPES] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner_data: dict[str, Any] = {}
    for rank, metadata in sorted(parts, key=lambda part: part[0]):
        for fqn, entry in metadata.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                entries.setdefault(fqn, entry)
                continue
            merged = entries.setdefault(fqn, TensorStorageMetadata(entry.properties, entry.size, []))
            if not isinstance(merged, TensorStorageMetadata):  # a tensor on one rank, not on another
                raise ValueError(f"entry {fqn!r}: rank {rank} wrote a tensor, a lower rank something else")
            held = {tuple(chunk.offsets): chunk for chunk in merged.chunks}
            for chunk in entry.chunks:
                same_place = held.get(tuple(chunk.offsets))
                if same_place is None:
                    merged.chunks.append(chunk)
                elif tuple(same_place.sizes) != tuple(chunk.sizes):
                    raise ValueError(
                        f"entry {fqn!r}: rank {rank} wrote a chunk at {list(chunk.offsets)} of size "
                        f"{list(chunk.sizes)}, another rank one of size {list(same_place.sizes)}"
                    )
        # MetadataIndex compares by (fqn, offset): a replica's record is not added twice.
        for index, info in (metadata.storage_data or {}).items():
            if index not in storage:
                storage[index] = dataclasses.replace(info, relative_path=rename(info.relative_path, rank))
        planner_data.update({k: v for k, v in (metadata.planner_data or {}).items() if k not in planner_data})
    first = min(parts, key=lambda part: part[0])[1]
    return Metadata(
        state_dict_metadata=entries,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
        version=first.version,
    )


def rank_file_name(name: str, rank: int) -> str:
    """``name`` (``…/__0_*.distcp``, a data file of a save without collectives, or its
    ``.content_hashes.json``) as rank ``rank``'s."""
    folder, base = posixpath.split(name)
    if base.startswith("__0_"):
        base = f"__{rank}_{base[len('__0_') :]}"
    elif base == CONTENT_HASHES_NAME:
        base = content_hashes_name(rank)
    return posixpath.join(folder, base)
