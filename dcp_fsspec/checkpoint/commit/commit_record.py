"""The commit record, ``.commit.json``: what it holds, and how its bytes are read.

Rank 0 writes it into an iteration's folder once every rank finished every key (see
:mod:`~dcp_fsspec.checkpoint.commit.committing`). It lists the keys saved and the save's token. A save that takes a folder over
puts a mark in its place first; a mark is not a record. Its bytes come from storage, so they are
parsed as untrusted: bounded in size, every field checked. Torch-free, for the tools.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.errors import CorruptCheckpointError
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME
from dcp_fsspec.storage.transport.urls import Location

_RECORD_FORMAT = 1
# What a save that takes over a folder holding something (a dead save's leftovers, or a commit
# it may replace) puts in the commit record's place before it deletes anything: the field naming
# that save's token. Only that save may replace it with a record.
_TAKEN_OVER_BY = "taken_over_by"
# What retention puts in the record's place when it lets go of an iteration whose files later
# iterations of an incremental run still refer to: the iteration no longer loads, but those
# files stay, and references to them stay valid (see :func:`referable`).
_RETIRED = "retired"
# A record is a few hundred bytes (a key name each); anything far bigger was not written by us,
# and is not parsed (json's nesting depth is bounded by its length).
_MAX_RECORD_BYTES = 1024 * 1024


@dataclass(frozen=True)
class CommitRecord:
    """What rank 0 writes into an iteration's folder once every rank finished every key."""

    iteration: int
    keys: tuple[str, ...]
    world_size: int
    saved_at: float  # seconds since the epoch, for humans and tools
    # The save's token: every key's .metadata carries it (storage_meta.save_id), so a folder
    # another save of the same iteration wrote into is never taken for this one. None: a record
    # written before tokens existed.
    save_id: str | None = None

    def to_json(self) -> bytes:
        doc: dict[str, object] = {
            "format": _RECORD_FORMAT,
            "iteration": self.iteration,
            "keys": list(self.keys),
            "world_size": self.world_size,
            "saved_at": self.saved_at,
        }
        if self.save_id is not None:
            doc["save_id"] = self.save_id
        return json.dumps(doc, indent=1).encode()


def record_path(root: Location, iteration: int) -> str:
    """The path of ``iteration``'s commit record under ``root``."""
    return posixpath.join(layout.iteration_path(root, iteration), COMMIT_RECORD_NAME)


def read_commit_record(root: Location, iteration: int) -> CommitRecord | None:
    """The commit record of ``iteration``, or ``None`` when its folder has none (or a save's
    take-over mark, or retention's retired mark, in its place: not an iteration to load).

    Raises:
        CorruptCheckpointError: the record exists but is not one we wrote.
        StorageError: the backend failed.
    """
    path = record_path(root, iteration)
    # One GET on S3, present or not (s3fs's cat_file asks HEAD first, then LIST when absent).
    return parse_record(root, path, root.backend.read_versioned(path).data)


def parse_record(root: Location, path: str, raw: bytes | None) -> CommitRecord | None:
    """The record ``raw`` holds; ``None`` for nothing, a take-over mark or a retired mark.

    Raises:
        CorruptCheckpointError: ``raw`` is neither (named by ``path``'s URL).
    """
    if raw is None:
        return None
    try:
        if len(raw) > _MAX_RECORD_BYTES:
            raise ValueError(f"{len(raw)} bytes, more than a commit record's {_MAX_RECORD_BYTES}")
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise TypeError("not an object")
        if doc.get("format") != _RECORD_FORMAT:
            raise ValueError(
                f"its format is {doc.get('format')!r}, this dcp_fsspec reads format {_RECORD_FORMAT}: "
                "written by another version or another program; upgrade dcp_fsspec to read it"
            )
        if isinstance(doc.get(_TAKEN_OVER_BY), str) or doc.get(_RETIRED) is True:
            return None
        if not isinstance(doc["keys"], list):
            raise TypeError("not an object with a list of keys")
        keys = tuple(layout.check_key(k) for k in doc["keys"])
        save_id = doc.get("save_id")
        if save_id is not None and not isinstance(save_id, str):
            raise TypeError("its save_id is not a string")
        return CommitRecord(
            int(doc["iteration"]), keys, int(doc["world_size"]), float(doc["saved_at"]), save_id
        )
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"commit record {root.url_of(path)} is unreadable ({e}); delete the folder "
            f"{root.url_of(posixpath.dirname(path))} if that iteration is not needed"
        ) from e


def take_over_mark(save_id: str) -> bytes:
    """What the save ``save_id`` puts in the record's place when it takes a folder over."""
    return json.dumps({"format": _RECORD_FORMAT, _TAKEN_OVER_BY: save_id}).encode()


def retired_mark(record: CommitRecord) -> bytes:
    """What retention puts in ``record``'s place when later iterations still refer to its files."""
    doc = json.loads(record.to_json())
    doc[_RETIRED] = True
    return json.dumps(doc, indent=1).encode()


def referable(root: Location, iteration: int) -> bool:
    """Whether another iteration may refer to ``iteration``'s files: it is committed, or retired
    by retention with the files referred to kept.

    Raises:
        CorruptCheckpointError: its record is not one we wrote.
        StorageError: the backend failed.
    """
    path = record_path(root, iteration)
    raw = root.backend.read_versioned(path).data
    if parse_record(root, path, raw) is not None:
        return True
    return raw is not None and json.loads(raw).get(_RETIRED) is True
