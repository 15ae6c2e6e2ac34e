"""Content hashes: how an incremental save knows which records its base holds already.

A save with content hashes digests every record it writes (xxh3-128 of the record's bytes before
any transform) and stores the digests in ``.content_hashes.json`` beside ``.metadata``, written
just before it. A later save given that checkpoint as its base digests each record first; where
the base stored the same entry with the same digest, the new ``.metadata`` refers to the base's
bytes (:mod:`~dcp_fsspec.storage.format.references`) instead of writing them again. Equality is decided by the 128-bit
digest, never by the CRC-32 the records also carry.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import fsspec
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_fsspec.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_fsspec.storage.format.metadata_file import read_metadata
from dcp_fsspec.storage.format.names import CONTENT_HASHES_NAME
from dcp_fsspec.storage.format.references import is_reference, reference_prefix, reference_problem
from dcp_fsspec.storage.format.tensor_records import FramedTensor
from dcp_fsspec.storage.transport.retry import RetryPolicy
from dcp_fsspec.storage.transport.urls import Location, resolve

logger = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview]

ALGORITHM = "xxh3-128"
_FORMAT = 1
_DIGEST_BYTES = 16
# A digest entry is its name, offsets and 32 hex digits: far below this for any real state.
_MAX_BYTES = 256 * 1024 * 1024


def record_digest(buffers: Iterable[Buffer]) -> bytes:
    """The xxh3-128 digest of a record's bytes, given as consecutive buffers."""
    digest = xxhash.xxh3_128()
    for buffer in buffers:
        digest.update(buffer)
    return digest.digest()


def encode_hashes(digests: Mapping[MetadataIndex, bytes], transforms: list[str], save_id: str) -> bytes:
    """``.content_hashes.json``'s bytes: each entry's digest, the transforms its records went
    through, and the save they belong to (the ``save_id`` in that save's ``.metadata``)."""
    entries = [
        [index.fqn, None if index.offset is None else list(index.offset), digest.hex()]
        for index, digest in digests.items()
    ]
    doc = {
        "format": _FORMAT,
        "algorithm": ALGORITHM,
        "save_id": save_id,
        "transforms": transforms,
        "entries": entries,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ContentHashes:
    """What a checkpoint's ``.content_hashes.json`` says."""

    save_id: str
    transforms: list[str]
    digests: dict[MetadataIndex, bytes]


def parse_hashes(raw: bytes, url: str) -> ContentHashes:
    """Parse ``.content_hashes.json``'s bytes (from ``url``), checking every field.

    Raises:
        CorruptCheckpointError: they are not a file this module wrote.
    """
    try:
        if len(raw) > _MAX_BYTES:
            raise ValueError(f"{len(raw)} bytes, more than the {_MAX_BYTES} allowed")
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("algorithm") != ALGORITHM:
            raise ValueError(f"not format {_FORMAT} of {ALGORITHM} digests")
        save_id, transforms = doc["save_id"], doc["transforms"]
        if not isinstance(save_id, str):
            raise TypeError("its save_id is not a string")
        if not isinstance(transforms, list) or not all(isinstance(t, str) for t in transforms):
            raise TypeError("its transforms are not a list of strings")
        digests = dict(_parse_entry(entry) for entry in doc["entries"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(f"the content hashes {url} are unreadable ({e})") from e
    return ContentHashes(save_id, transforms, digests)


def _parse_entry(entry: object) -> tuple[MetadataIndex, bytes]:
    if not isinstance(entry, list) or len(entry) != 3:
        raise TypeError(f"entry {entry!r:.80} is not [name, offsets, digest]")
    fqn, offset, digest = entry
    if not isinstance(fqn, str) or not isinstance(digest, str) or len(digest) != 2 * _DIGEST_BYTES:
        raise TypeError(f"entry {entry!r:.80} is not [name, offsets, digest]")
    if offset is not None and not (
        isinstance(offset, list) and all(type(o) is int and o >= 0 for o in offset)
    ):
        raise TypeError(f"entry {fqn!r:.80} has offsets {offset!r:.80}")
    return MetadataIndex(fqn, offset), bytes.fromhex(digest)


@dataclass(frozen=True)
class BaseRecord:
    """A record of the base: its digest, and where the new checkpoint finds its bytes."""

    digest: bytes
    info: _StorageInfo


def read_base(base: Location, folder: str, transforms: list[str]) -> dict[MetadataIndex, BaseRecord]:
    """The records of the checkpoint at ``base`` that a save into ``folder`` may refer to, by entry.

    Args:
        base: the base checkpoint's folder: a sibling of ``folder`` (see :mod:`~dcp_fsspec.storage.format.references`).
        folder: the new checkpoint's path.
        transforms: the new save's transforms; a base written through others gives nothing.

    Returns:
        Entry → digest and storage info as the new ``.metadata`` names it (a reference). Empty
        when ``base`` stored no content hashes of its own save, they are damaged, or it wrote
        through other transforms (each said at WARNING: the save then writes every record).

    Raises:
        ValueError: ``base`` is not a sibling checkpoint of ``folder``.
        CheckpointNotFoundError: ``base`` holds no checkpoint.
        CorruptCheckpointError: its ``.metadata`` is damaged.
    """
    prefix = base_prefix(folder, base)
    try:
        metadata = read_metadata(base, references=True)
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(
            f"the base {base.url} holds no checkpoint (no .metadata); give a committed one"
        ) from e
    path = base.join(CONTENT_HASHES_NAME)
    raw = base.backend.read_versioned(path).data
    if raw is None:
        logger.warning(
            "the base %s stored no content hashes (not an incremental save): writing every record", base.url
        )
        return {}
    try:
        hashes = parse_hashes(raw, base.url_of(path))
    except CorruptCheckpointError as e:
        logger.warning("%s: writing every record", e)
        return {}
    if hashes.save_id != getattr(metadata.storage_meta, "save_id", None):
        # Left by another save into the base's folder: its digests say nothing of these records.
        logger.warning(
            "the content hashes of the base %s belong to another save: writing every record", base.url
        )
        return {}
    if hashes.transforms != transforms:
        logger.warning(
            "the base %s was written with transforms %s, this save uses %s: writing every record",
            base.url,
            hashes.transforms,
            transforms,
        )
        return {}
    records = {}
    for index, info in (metadata.storage_data or {}).items():
        digest = hashes.digests.get(index)
        if digest is None:
            continue
        # The base's own file; or its reference, which reads the same from here, unless it
        # names the new folder itself (a base older than an iteration saved again).
        name = info.relative_path
        if not is_reference(name):
            name = prefix + name
        elif reference_problem(name, folder) is not None:
            continue
        records[index] = BaseRecord(
            digest, _StorageInfo(name, info.offset, info.length, info.transform_descriptors)
        )
    return records


def base_of(
    location: Location,
    base: str | os.PathLike[str],
    storage_options: dict[str, Any] | None,
    fs: fsspec.AbstractFileSystem | None,
    retry: RetryPolicy | None,
) -> Location:
    """The base checkpoint at ``base`` of a save into ``location``, on the same filesystem.

    Raises:
        ValueError: ``base`` is not a checkpoint ``location`` may refer to.
    """
    found = resolve(base, storage_options, fs or location.fs, retry=retry)
    base_prefix(location.path, found)
    return found


def base_prefix(folder: str, base: Location) -> str:
    """The relative path from the checkpoint at ``folder`` to ``base`` (``../step-10/``).

    Raises:
        ValueError: ``base`` is not a checkpoint ``folder`` may refer to.
    """
    prefix = reference_prefix(folder, base.path)
    if prefix is None:
        raise ValueError(
            f"the base {base.url} is not a sibling checkpoint of the one being saved: give one beside it "
            "in the same run ('run/step-10' for 'run/step-20', or another iteration's same key)"
        )
    return prefix


def content_digest(data: Any, framed: FramedTensor | None) -> bytes:
    """The content digest of one record: its header (dtype and shape) and bytes, or an object's bytes."""
    return record_digest([data.getbuffer()] if framed is None else [framed.header, framed.data])


BaseRecords = dict[MetadataIndex, BaseRecord]


@dataclasses.dataclass
class IncrementalPrefix(_StoragePrefix):
    """A rank's file prefix, with the base's records of the items it writes (from the coordinator)."""

    base: BaseRecords = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Hashed:
    """An incremental save's storage info of one record, with its digest for the coordinator."""

    info: _StorageInfo
    digest: bytes


def unhashed(stored: _StorageInfo | Hashed) -> _StorageInfo:
    """The storage info of a record, whether or not it carries a digest."""
    return stored.info if isinstance(stored, Hashed) else stored
