"""Making a checkpoint self-contained: the records it refers to, copied into data files of its own.

An incremental save refers to records of its base (:mod:`~dcp_fsspec.storage.format.references`). A copy that must stand
alone (``cp``, a drain to a tier without the base) gets those records' bytes in new data files,
``__ref_<n>.distcp``, one per referenced file, packed in offset order. Where every record of a
referenced file is needed, the new file is that file whole, at the same offsets. Its
``.metadata`` is rewritten to name them; nothing else in it changes, so the
``.content_hashes.json`` beside it still describes its records.
"""

from __future__ import annotations

import dataclasses
import pickle
import posixpath
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcp_fsspec.errors import CorruptCheckpointError
from dcp_fsspec.storage.checkpoint_files.copying import Piece
from dcp_fsspec.storage.format.metadata_file import read_metadata
from dcp_fsspec.storage.format.names import CONTENT_HASHES_NAME, DATA_SUFFIX, METADATA_NAME
from dcp_fsspec.storage.format.references import is_reference
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.urls import Location

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


@dataclass(frozen=True)
class SelfContained:
    """What a self-contained copy of one checkpoint writes in place of its references.

    Attributes:
        metadata: the rewritten ``.metadata``.
        files: each new data file (a name in the checkpoint's folder) and the pieces it holds, in order.
    """

    metadata: bytes
    files: dict[str, list[Piece]]


def folder_sizes(location: Location, folders: Iterable[str]) -> dict[str, int]:
    """Every file in each of ``folders`` (paths on ``location``'s filesystem): path → size.

    One listing per folder; a missing folder lists nothing.

    Raises:
        StorageError: the backend failed.
    """
    sizes: dict[str, int] = {}
    for folder in sorted(set(folders)):
        location.fs.invalidate_cache(folder)
        try:
            with storage_errors("list", location.url_of(folder)):
                entries = location.fs.ls(folder, detail=True)
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.get("type") != "directory":
                sizes[posixpath.join(folder, posixpath.basename(str(entry["name"]).rstrip("/")))] = int(
                    entry.get("size") or 0
                )
    return sizes


def plan_self_contained(
    location: Location,
    metadata: Metadata,
    own: Iterable[str],
    *,
    keep: Callable[[str], bool] = lambda path: False,
    prefix: str = "__ref_",
) -> SelfContained | None:
    """How the checkpoint at ``location`` (whose ``.metadata`` is ``metadata``, read with its
    references checked) becomes self-contained; ``None`` when it refers to nothing to copy.

    Args:
        location: the checkpoint folder.
        metadata: its ``.metadata``, as :func:`~dcp_fsspec.storage.format.metadata_file.read_metadata` returned it.
        own: the names of the files in its folder (the new files' names avoid them).
        keep: whether a reference to a file (its path) stays as it is: the copy holds that
            file too.
        prefix: how the new data files' names start.

    Raises:
        CorruptCheckpointError: a referenced checkpoint has no ``.metadata``, or a referenced file
            is missing or too short; the message names both checkpoints.
        StorageError: listing the referenced folders failed.
    """
    storage = metadata.storage_data or {}
    by_file: dict[str, set[tuple[int, int]]] = {}
    for info in storage.values():
        if is_reference(info.relative_path) and not keep(location.join(info.relative_path)):
            by_file.setdefault(info.relative_path, set()).add((info.offset, info.offset + info.length))
    if not by_file:
        return None
    sizes = folder_sizes(location, (posixpath.dirname(location.join(ref)) for ref in by_file))
    taken = set(own)
    names = (f"{prefix}{n}{DATA_SUFFIX}" for n in range(len(taken) + len(by_file) + 1))
    files: dict[str, list[Piece]] = {}
    moved: dict[tuple[str, int], tuple[str, int]] = {}  # (reference, offset) -> (new name, new offset)
    for ref, ranges in sorted(by_file.items()):
        path = location.join(ref)
        _require_present(location, ref, path, max(end for _, end in ranges), sizes)
        name = next(n for n in names if n not in taken)
        pieces: list[Piece] = []
        for start, end in sorted(ranges):
            if pieces and start < pieces[-1][2]:
                raise _corrupt(location, path, f"its records at bytes {pieces[-1][1]} and {start} overlap")
            moved[(ref, start)] = (name, sum(e - s for _, s, e in pieces))
            pieces.append((path, start, end))
        files[name] = pieces
    rewritten = {}
    for index, info in storage.items():
        place = moved.get((info.relative_path, info.offset))
        rewritten[index] = (
            info if place is None else dataclasses.replace(info, relative_path=place[0], offset=place[1])
        )
    return SelfContained(pickle.dumps(dataclasses.replace(metadata, storage_data=rewritten)), files)


def self_contained_files(
    source: Location,
    files: Mapping[str, int],
    *,
    keep: Callable[[str], bool] = lambda path: False,
    references: bool = False,
    trust_checkpoint: bool = False,
    prefix: str = "__ref_",
) -> tuple[dict[str, list[Piece]], dict[str, bytes]]:
    """What a copy of ``files`` writes so that every checkpoint among them stands alone.

    Args:
        source: where ``files`` are (names relative to its root, as :func:`~dcp_fsspec.storage.checkpoint_files.copying.list_files` gives).
        files: the files copied; each ``.metadata`` among them is read.
        keep, prefix: see :func:`plan_self_contained`.
        references: follow references to sibling checkpoints (``../step-10/…``) too.
        trust_checkpoint: unpickle each ``.metadata`` in full, whatever classes it names.

    Returns:
        The data files to assemble, and each ``.metadata`` to write in place of the source's
        (names relative to ``source``'s root).

    Raises:
        CorruptCheckpointError: a ``.metadata`` cannot be read (a reference to a sibling
            checkpoint without ``references``), or a referenced file is missing or too short.
        StorageError: the backend failed.
    """
    assembled: dict[str, list[Piece]] = {}
    written: dict[str, bytes] = {}
    # Only an incremental save (content hashes beside its .metadata) refers to other checkpoints.
    hashed = {posixpath.dirname(n) for n in files if posixpath.basename(n) == CONTENT_HASHES_NAME}
    for name in sorted(
        n for n in files if posixpath.basename(n) == METADATA_NAME and posixpath.dirname(n) in hashed
    ):
        folder = posixpath.dirname(name)
        key = source.at(source.join(folder)) if folder else source
        metadata = read_metadata(key, references=references, trust_checkpoint=trust_checkpoint)
        own = [posixpath.basename(n) for n in files if posixpath.dirname(n) == folder]
        plan = plan_self_contained(key, metadata, own, keep=keep, prefix=prefix)
        if plan is not None:
            written[name] = plan.metadata
            assembled.update({posixpath.join(folder, n): pieces for n, pieces in plan.files.items()})
    return assembled, written


def _require_present(location: Location, ref: str, path: str, end: int, sizes: dict[str, int]) -> None:
    folder = posixpath.dirname(path)
    if posixpath.join(folder, METADATA_NAME) not in sizes:
        raise _corrupt(
            location, path, f"{location.url_of(folder)} is not a committed checkpoint (no {METADATA_NAME})"
        )
    size = sizes.get(path)
    if size is None:
        raise _corrupt(location, path, "it does not exist")
    if size < end:
        raise _corrupt(location, path, f"it is {size} bytes, but records are referred to up to byte {end}")


def _corrupt(location: Location, path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"cannot make a self-contained copy of {location.url}: it refers to records of "
        f"{location.url_of(path)}, but {what}; restore that checkpoint, or copy another one"
    )
