"""What makes an iteration committed, and the ``latest_checkpoint.txt`` pointer.

An iteration is *committed* when its folder holds a commit record (``.commit.json``, listing the
keys saved) and every key it lists is a finished DCP checkpoint (has DCP's ``.metadata``). The
record is written by rank 0 only after every rank finished every key, so a folder left by a
crash at any point, even one whose keys all happen to be finished, is never taken for a
checkpoint. The pointer names the newest committed iteration; it is written atomically, only
after the commit record, and never moves backwards, even with two writers: each update is a
compare-and-swap. Deleting an iteration removes the record first, so a half-deleted folder is
uncommitted rather than a damaged checkpoint.

This module says *what* must be atomic and in which order; *how* each store does it (a rename,
a conditional PUT, a lock on the folder) is the storage backend's (:mod:`dcp_fsspec.storage.backends`):
``write_small_atomic``, ``read_versioned``, ``replace_if_unchanged`` inside ``exclusive``.
Every storage call is retried by the location's ``RetryPolicy``.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from functools import partial

from ..errors import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ..storage.backends import Versioned
from ..storage.names import COMMIT_RECORD_NAME, METADATA_NAME, POINTER_NAME
from ..storage.urls import Location
from . import layout
from .at_once import at_once

if TYPE_CHECKING:  # torch's: ls, prune and cp import this module without it
    from torch.distributed.checkpoint.metadata import Metadata

logger = logging.getLogger(__name__)

_RECORD_FORMAT = 1
# In an iteration folder while a save writes it: which save took the folder first.
CLAIM_NAME = ".saving"
# What a save that takes over a folder holding something (a dead save's leftovers, or a commit
# it may replace) puts in the commit record's place before it deletes anything: the field naming
# that save's token. Only that save may replace it with a record.
_TAKEN_OVER_BY = "taken_over_by"
# A record is a few hundred bytes (a key name each); anything far bigger was not written by us,
# and is not parsed (json's nesting depth is bounded by its length).
_MAX_RECORD_BYTES = 1024 * 1024
# How often a pointer update re-reads and tries again after losing a race to another writer.
_POINTER_ROUNDS = 20


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


def pointer_url(root: Location) -> str:
    """The URL of ``root``'s pointer file, for messages."""
    return root.url_of(root.join(POINTER_NAME))


def exists(root: Location, path: str) -> bool:
    """Whether ``path`` exists; unlike ``fs.exists``, a backend failure is an error, not False.

    Treating a network error as "missing" would let retention delete a committed iteration.
    """
    root.backend.invalidate(posixpath.dirname(path))
    try:
        root.backend.call("info", path)
    except FileNotFoundError:
        return False
    return True


def folder_exists(root: Location, path: str) -> bool:
    """Whether the folder ``path`` exists (holds anything, on object stores); a backend failure
    is an error, as in :func:`exists`. One request on S3."""
    return root.backend.folder_exists(path)


def read_commit_record(root: Location, iteration: int) -> CommitRecord | None:
    """The commit record of ``iteration``, or ``None`` when its folder has none (or a save's
    take-over mark in its place: that save has not committed).

    Raises:
        CorruptCheckpointError: the record exists but is not one we wrote.
        StorageError: the backend failed.
    """
    path = root.join(layout.format_iteration(iteration), COMMIT_RECORD_NAME)
    # One GET on S3, present or not (s3fs's cat_file asks HEAD first, then LIST when absent).
    return _parse_record(root, path, root.backend.read_versioned(path).data)


def _parse_record(root: Location, path: str, raw: bytes | None) -> CommitRecord | None:
    """The record ``raw`` holds; ``None`` for nothing or a take-over mark.

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
        if isinstance(doc.get(_TAKEN_OVER_BY), str):
            return None
        if not isinstance(doc["keys"], list):
            raise TypeError("not an object with a list of keys")
        keys = tuple(layout.check_key(k) for k in doc["keys"])
        save_id = doc.get("save_id")
        if save_id is not None and not isinstance(save_id, str):
            raise TypeError("its save_id is not a string")
        return CommitRecord(int(doc["iteration"]), keys, int(doc["world_size"]), float(doc["saved_at"]), save_id)
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"commit record {root.url_of(path)} is unreadable ({e}); delete the folder "
            f"{root.url_of(posixpath.dirname(path))} if that iteration is not needed"
        ) from e


def _take_over_mark(save_id: str) -> bytes:
    return json.dumps({"format": _RECORD_FORMAT, _TAKEN_OVER_BY: save_id}).encode()


def key_is_committed(root: Location, iteration: int, key: str) -> bool:
    """Whether ``key`` of ``iteration`` is a finished DCP checkpoint (has ``.metadata``)."""
    return exists(root, posixpath.join(layout.key_path(root, iteration, key), METADATA_NAME))


def _files_of(root: Location, iteration: int) -> dict[str, int]:
    """Every file under ``iteration``'s folder → its size: one recursive listing."""
    found = root.backend.find(layout.iteration_path(root, iteration))
    return {path: int(info.get("size") or 0) for path, info in found.items()}


def unfinished_keys(
    root: Location, iteration: int, keys: tuple[str, ...], listed: Collection[str] | None = None
) -> list[str]:
    """The ``keys`` of ``iteration`` that have no ``.metadata``, in one listing where possible.

    One recursive listing (``listed``, when the caller has made it) is one request on object
    stores, against one per key. fsspec's generic listing skips folders it fails to read,
    though, so each absence it reports is confirmed with a check that raises on failure: an
    error never reads as "missing".
    """
    folder = layout.iteration_path(root, iteration)
    listed = _files_of(root, iteration) if listed is None else listed
    absent = [k for k in keys if posixpath.join(folder, k, METADATA_NAME) not in listed]
    return [k for k in absent if not key_is_committed(root, iteration, k)]


@dataclass(frozen=True)
class FolderRead:
    """An iteration folder as one round trip reads it: its listing and each key's ``.metadata``.

    Attributes:
        listed: every file under the folder (one recursive listing) → its size.
        metadata: each key asked about → the bytes of its ``.metadata``, ``None`` where it has
            none (read with a call that raises on failure: an error never reads as "missing").
        parsed: each key whose ``.metadata`` the token check parsed → the result, so that a
            load that goes on to read the key does not parse it again.
    """

    listed: dict[str, int]
    metadata: dict[str, bytes | None]
    parsed: dict[str, Metadata] = field(default_factory=dict, compare=False, repr=False)

    def unfinished(self, keys: tuple[str, ...]) -> list[str]:
        """The ``keys`` that have no ``.metadata``, in order."""
        return [k for k in keys if self.metadata[k] is None]

    def sizes_in(self, folder: str) -> dict[str, int]:
        """The files directly in ``folder`` (a key's, under this one) by name → size: what a
        load's check of its data files would list again."""
        prefix = folder.rstrip("/") + "/"
        return {path[len(prefix) :]: size for path, size in self.listed.items()
                if path.startswith(prefix) and "/" not in path[len(prefix) :]}  # fmt: skip


def folder_reads(root: Location, iteration: int, keys: tuple[str, ...]) -> list[Callable[[], object]]:
    """The calls that read ``iteration``'s folder for ``keys``, to send with others at once
    (:func:`.at_once.at_once`); :func:`folder_read` makes their results a :class:`FolderRead`."""
    return [partial(_files_of, root, iteration), *(partial(_metadata_bytes, root, iteration, k) for k in keys)]


def folder_read(results: list[object], keys: tuple[str, ...]) -> FolderRead:
    """The :class:`FolderRead` of :func:`folder_reads`'s results."""
    listed, *metadata = results
    assert isinstance(listed, dict)
    return FolderRead(listed, dict(zip(keys, metadata, strict=True)))  # type: ignore[arg-type]


def read_folder(root: Location, iteration: int, keys: tuple[str, ...]) -> FolderRead:
    """``iteration``'s listing and each of ``keys``' ``.metadata``, read at once."""
    return folder_read(at_once(folder_reads(root, iteration, keys), one_by_one=root.answers_locally), keys)


def _metadata_bytes(root: Location, iteration: int, key: str) -> bytes | None:
    # One GET on S3, present or not.
    return root.backend.read_versioned(posixpath.join(layout.key_path(root, iteration, key), METADATA_NAME)).data


def inspect_iteration(
    root: Location, iteration: int, *, latest: int | None = None
) -> tuple[CommitRecord | None, str | None]:
    """``(record, None)`` if ``iteration`` is committed, else ``(None, why not)`` in words.

    Args:
        root: the ``save_dirname`` location.
        iteration: the iteration to look at.
        latest: the iteration the pointer names, if known: a folder without a record older than
            it may also be one that retention began to delete (it removes the record first).
    """
    record = read_commit_record(root, iteration)
    present = record is not None or folder_exists(root, layout.iteration_path(root, iteration))
    return judge_iteration(root, iteration, record, present, latest=latest)


def judge_iteration(
    root: Location, iteration: int, record: CommitRecord | None, present: bool, *, latest: int | None = None
) -> tuple[CommitRecord | None, str | None]:
    """:func:`inspect_iteration` from what the caller read: ``iteration``'s commit record
    (:func:`read_commit_record`) and whether its folder exists (:func:`folder_exists`), which a caller
    may read together with other things in one round trip."""
    if record is None:
        return None, _no_record(iteration, latest) if present else "does not exist"
    unfinished = unfinished_keys(root, iteration, record.keys)
    if unfinished:
        return None, _unfinished(root, iteration, unfinished[0])
    return record, None


def _no_record(iteration: int, latest: int | None) -> str:
    if latest is not None and iteration < latest:
        return (
            f"has no {COMMIT_RECORD_NAME}: a save that failed, or a deletion by retention that was "
            "interrupted, left it; retention deletes it at the next save"
        )
    return f"has no {COMMIT_RECORD_NAME} (its save never finished)"


def _unfinished(root: Location, iteration: int, key: str) -> str:
    return f"lacks {root.url_of(posixpath.join(layout.key_path(root, iteration, key), METADATA_NAME))}"


@dataclass(frozen=True)
class Listing:
    """What one recursive listing of ``save_dirname`` says about its iteration folders.

    Deciding from names costs one listing for any number of folders, against several requests
    per folder. An absence it reports is trusted only where the listing shows the folder was
    read (something is listed inside it): fsspec's generic listing skips folders it fails to
    read, and an error must never read as "not committed" (retention would delete on a guess).

    Attributes:
        folders: every iteration that has a folder, ascending.
        read: the iterations with anything listed inside their folder.
        records: the iterations whose folder lists ``.commit.json``.
        finished: ``(iteration, key)`` for each key folder that lists ``.metadata``.
        sizes: the bytes of the files listed in each iteration's folder.
    """

    folders: tuple[int, ...]
    read: frozenset[int]
    records: frozenset[int]
    finished: frozenset[tuple[int, str]]
    sizes: Mapping[int, int] = field(default_factory=dict)


def list_save_dirname(root: Location) -> Listing:
    """One recursive listing of ``root`` (one request per 1,000 files on S3).

    Raises:
        StorageError: the backend failed.
    """
    found = root.backend.find(root.path, withdirs=True)
    prefix = root.path.rstrip("/") + "/"
    bare: set[int] = set()
    read: set[int] = set()
    records: set[int] = set()
    finished: set[tuple[int, str]] = set()
    sizes: dict[int, int] = {}
    for name, info in found.items():
        parts = name[len(prefix):].rstrip("/").split("/") if name.startswith(prefix) else []
        iteration = layout.parse_iteration(parts[0]) if parts else None
        if iteration is None:
            continue
        (read if len(parts) > 1 else bare).add(iteration)
        if len(parts) > 1 and info.get("type") != "directory":
            sizes[iteration] = sizes.get(iteration, 0) + int(info.get("size") or 0)
        if parts[1:] == [COMMIT_RECORD_NAME]:
            records.add(iteration)
        elif len(parts) == 3 and parts[2] == METADATA_NAME:
            finished.add((iteration, parts[1]))
    # A name with nothing listed under it is an empty folder or a file of that name: only an
    # empty folder, which object stores do not have, costs a request to tell them apart.
    folders = read | {i for i in bare - read if _is_folder(root, layout.iteration_path(root, i))}
    return Listing(tuple(sorted(folders)), frozenset(read), frozenset(records), frozenset(finished), sizes)


def _is_folder(root: Location, path: str) -> bool:
    try:
        return bool(root.backend.call("info", path).get("type") == "directory")
    except FileNotFoundError:
        return False


def listed_record(root: Location, listing: Listing, iteration: int) -> CommitRecord | None:
    """The commit record of ``iteration`` if it is committed, deciding from ``listing``.

    Reads the record only where the listing shows one (or could not see inside the folder),
    and confirms each ``.metadata`` the listing lacks with a check that raises on failure.

    Raises:
        CorruptCheckpointError: the record is not one we wrote.
        StorageError: the backend failed.
    """
    return listed_inspection(root, listing, iteration)[0]


def listed_inspection(
    root: Location, listing: Listing, iteration: int, *, latest: int | None = None
) -> tuple[CommitRecord | None, str | None]:
    """:func:`inspect_iteration`, deciding from ``listing``: a folder the listing shows without a
    commit record costs no request; one with a record costs reading it.

    Raises:
        CorruptCheckpointError: the record is not one we wrote.
        StorageError: the backend failed.
    """
    if iteration not in listing.records and iteration in listing.read:
        return None, _no_record(iteration, latest)
    record = read_commit_record(root, iteration)
    if record is None:
        return None, _no_record(iteration, latest)
    for key in record.keys:
        if (iteration, key) not in listing.finished and not key_is_committed(root, iteration, key):
            return None, _unfinished(root, iteration, key)
    return record, None


def committed_iterations(root: Location) -> list[int]:
    """The committed iterations under ``root``, ascending: one listing, and one read of each
    commit record it shows (folders without one cost nothing more)."""
    listing = list_save_dirname(root)
    return [i for i in listing.folders if listed_record(root, listing, i) is not None]


def require_committed(root: Location, iteration: int, *, named_by: str) -> CommitRecord:
    """The commit record of ``iteration``, or a CheckpointNotFoundError naming ``named_by``.

    Args:
        root: the ``save_dirname`` location.
        iteration: the iteration that must be committed.
        named_by: what pointed at it (the pointer URL), so the message names both.
    """
    record, reason = inspect_iteration(root, iteration)
    if record is None:
        raise _not_committed(root, iteration, str(reason), named_by)
    return record


def require_loadable(
    root: Location, iteration: int, *, named_by: str, trust_checkpoint: bool = False
) -> tuple[CommitRecord, FolderRead]:
    """:func:`require_committed` and :func:`require_saved_together` in two round trips: the
    commit record, then the folder's listing and every key's ``.metadata`` at once; returns
    the record and what was read of the folder (a load parses those ``.metadata`` again rather
    than reading them again).

    Raises:
        CheckpointNotFoundError: ``iteration`` is not committed (the message names ``named_by``).
        CorruptCheckpointError: the record, or a key's ``.metadata``, is not this save's.
        StorageError: the backend failed.
    """
    record = read_commit_record(root, iteration) or require_committed(root, iteration, named_by=named_by)
    folder = read_folder(root, iteration, record.keys)
    unfinished = folder.unfinished(record.keys)
    if unfinished:
        raise _not_committed(root, iteration, _unfinished(root, iteration, unfinished[0]), named_by)
    require_saved_together(root, record, trust_checkpoint=trust_checkpoint, folder=folder)
    return record, folder


def _not_committed(root: Location, iteration: int, reason: str, named_by: str) -> CheckpointNotFoundError:
    folder = root.url_of(layout.iteration_path(root, iteration))
    committed = [layout.format_iteration(i) for i in committed_iterations(root)]
    if named_by != pointer_url(root):  # load(iteration=N): another N is the way out
        advice = "Load one of those (load(iteration=N))" if committed else "Save one first"
    else:
        advice = (
            f"Restore that folder, or rewrite {POINTER_NAME} to name a committed iteration (or delete it to start over)"
        )
    return CheckpointNotFoundError(
        f"{named_by} names {folder}, which {reason}; committed iterations there: {committed or 'none'}. {advice}"
    )


def require_saved_together(
    root: Location, record: CommitRecord, *, trust_checkpoint: bool = False, folder: FolderRead | None = None
) -> None:
    """Check that every key ``record`` lists is the save that wrote ``record`` (its token).

    A folder two saves of one iteration wrote into is never loaded as one checkpoint. A record
    written before tokens existed (no ``save_id``) is not checked. ``folder``: the folder as the
    caller read it (:func:`read_folder`), else it is read here.

    Raises:
        CorruptCheckpointError: a key's ``.metadata`` carries another save's token, or names a
            missing file; the message names the URL.
        StorageError: the backend failed.
    """
    if record.save_id is None:
        return
    folder = read_folder(root, record.iteration, record.keys) if folder is None else folder
    problem = _first_key_problem(root, record.iteration, record.keys, record.save_id, folder, trust_checkpoint=trust_checkpoint)
    if problem is not None:
        raise CorruptCheckpointError(
            f"{root.url_of(layout.iteration_path(root, record.iteration))} is not the checkpoint its {COMMIT_RECORD_NAME} committed: {problem} (another "
            "process saved the same iteration into it); it is not loaded. Load another iteration, "
            "or delete this folder"
        )


def publish(
    root: Location,
    iteration: int,
    keys: tuple[str, ...],
    world_size: int,
    *,
    behind_pointer: bool = False,
    save_id: str | None = None,
    taken_over: bool = False,
) -> int:
    """Commit ``iteration`` and move the pointer to it: the last step of a save, on rank 0.

    One versioned read of the pointer serves both the check that no other run published a newer
    iteration while this one was written and the compare-and-swap that moves it; only a lost race
    reads it again. It goes out with the iteration's listing and every key's ``.metadata`` (the
    commit's checks): one round trip, then the record's write, then the pointer's.

    Args:
        root: the ``save_dirname`` location.
        iteration: the iteration every rank finished writing.
        keys: the keys it holds (each must have ``.metadata``).
        world_size: how many ranks wrote it, for the commit record.
        behind_pointer: an explicit overwrite of an iteration older than the pointer: it is
            committed, and the pointer stays where it is.
        save_id: the save's token, which every key's ``.metadata`` must carry (see
            :func:`commit_record`).
        taken_over: the save took the folder over (:func:`take_over_iteration`).

    Returns:
        The iteration the pointer names afterwards (``iteration``, or a newer one).

    Raises:
        CheckpointExistsError: the pointer names a newer iteration (and not ``behind_pointer``),
            or another process saving the same iteration wrote into it or committed it first.
        CheckpointNotFoundError: a key has no ``.metadata``.
        StorageError: the backend failed; the pointer did not move.
    """
    with root.backend.exclusive(root.path):
        read, *found = at_once([partial(_read_pointer_file, root), *folder_reads(root, iteration, keys)],
                               one_by_one=root.answers_locally)  # fmt: skip
        current = _parse_pointer(root, read.data)
        if current is not None and current > iteration and not behind_pointer:
            raise _moved_past(root, iteration, current)
        commit_record(root, iteration, keys, world_size, save_id, taken_over=taken_over, folder=folder_read(found, keys))
        if current is not None and current >= iteration:
            latest = current
        elif _replace_pointer(root, _pointer_bytes(iteration), read):
            latest = iteration
        else:
            latest = None
    if latest is None:
        # Another writer changed the pointer between our read and our write: the full loop decides.
        latest = iteration if write_pointer(root, iteration) else _require_pointer(root)
    _still_ours(root, iteration, save_id)
    return latest


def _still_ours(root: Location, iteration: int, save_id: str | None) -> None:
    """Where conditional writes, not a lock, settle races (S3), check after the pointer moved
    that this save's record is still there: another save of the same iteration that saw it before
    the pointer moved may have taken it for a dead save's and replaced it. That save re-reads the pointer after its
    take-over mark (:func:`take_over_iteration`); one of the two re-reads always sees the other's
    write, so at most one of them reports success.

    Raises:
        CheckpointExistsError: the record is another save's, or a take-over mark, now.
    """
    if not root.backend.conditional_writes or save_id is None:
        return  # exclusive() is a lock across processes here (or nothing settles the race at all)
    record = read_commit_record(root, iteration)
    if record is None or record.save_id != save_id:
        raise CheckpointExistsError(
            f"cannot save {root.url_of(layout.iteration_path(root, iteration))}: another process "
            f"saving the same iteration into {root.url} took it over while this save committed it. "
            "Give each run its own save_dirname"
        )


def _require_pointer(root: Location) -> int:
    latest = read_pointer(root)
    if latest is None:  # pragma: no cover - write_pointer returned False because one is newer
        raise StorageError(f"{pointer_url(root)} disappeared while this save moved it; save again")
    return latest


def _moved_past(root: Location, iteration: int, latest: int) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"cannot commit {root.url_of(layout.iteration_path(root, iteration))}: {pointer_url(root)} "
        f"moved to the newer {layout.format_iteration(latest)} while it was being saved, so another "
        f"run is saving to {root.url}; the pointer never moves backwards, so this iteration stays "
        "uncommitted. Give each run its own save_dirname"
    )


def commit_record(
    root: Location,
    iteration: int,
    keys: tuple[str, ...],
    world_size: int,
    save_id: str | None = None,
    *,
    taken_over: bool = False,
    folder: FolderRead | None = None,
) -> CommitRecord:
    """Write ``iteration``'s commit record once each of ``keys`` is a finished DCP checkpoint
    of this save.

    With ``save_id`` (the save's token), each key's ``.metadata`` must carry it and every data
    file it names must be there: another process saving the same iteration into this folder
    (a restarted job and its zombie) may have written, or cleared, some of it. The record is
    created, never replaced (a conditional write; the caller holds ``exclusive(root)`` where the
    store has no conditional writes), so of two such saves one commits and the other raises.
    ``taken_over``: this save put its mark in the record's place (:func:`take_over_iteration`);
    the record replaces that mark only if it is still there. ``folder``: the folder as the
    caller read it (:func:`read_folder`), else it is read here.

    Raises:
        CheckpointNotFoundError: a key has no ``.metadata`` (its save did not finish).
        CheckpointExistsError: another save of this iteration wrote a key, or committed first.
    """
    folder = read_folder(root, iteration, keys) if folder is None else folder
    folder_url = root.url_of(layout.iteration_path(root, iteration))
    for key in folder.unfinished(keys):
        url = root.url_of(layout.key_path(root, iteration, key))
        raise CheckpointNotFoundError(
            f"cannot commit {folder_url}: key {key!r} at {url} has no {METADATA_NAME}, so its save "
            "did not finish; save the iteration again"
        )
    problem = None if save_id is None else _first_key_problem(root, iteration, keys, save_id, folder)
    if problem is not None:
        raise CheckpointExistsError(
            f"cannot commit {folder_url}: {problem}, so another process is saving the same "
            f"iteration into {root.url} (a restarted job racing the old one, or two jobs with "
            "one save_dirname); this save is not committed. Give each run its own save_dirname"
        )
    record = CommitRecord(iteration, tuple(keys), world_size, time.time(), save_id)
    path = root.join(layout.format_iteration(iteration), COMMIT_RECORD_NAME)
    if taken_over and save_id is not None:
        # Our mark must still be there: another save that took the folder over since replaced it.
        read = root.backend.read_versioned(path)
        created = read.data == _take_over_mark(save_id) and root.backend.replace_if_unchanged(path, record.to_json(), read)
    else:
        created = create_atomically(root, path, record.to_json())
    if not created:
        raise CheckpointExistsError(
            f"cannot commit {folder_url}: another process committed it, or took it over, while this "
            f"save wrote it (two processes saving the same iteration into {root.url}); this save is "
            "not committed. Give each run its own save_dirname"
        )
    return record


def _first_key_problem(
    root: Location, iteration: int, keys: tuple[str, ...], save_id: str, folder: FolderRead, *, trust_checkpoint: bool = False
) -> str | None:
    """Why the first of ``keys`` (in order) that is not the save ``save_id`` wrote is not, in
    words; ``None`` if every key is.

    A key is that save's when its ``.metadata`` (as ``folder`` read it) carries ``save_id`` and
    every data file it names is there (in ``folder``'s listing, or confirmed one by one).
    ``trust_checkpoint``: unpickle ``.metadata`` in full (see :func:`~dcp_fsspec.storage.decoding.parse_metadata`).

    Raises:
        CorruptCheckpointError: a ``.metadata`` is not DCP metadata.
        StorageError: the backend failed.
    """
    from ..storage.decoding import parse_metadata  # needs torch; ls, prune and cp never get here

    for key in keys:
        key_folder = layout.key_path(root, iteration, key)
        url = root.url_of(posixpath.join(key_folder, METADATA_NAME))
        raw = folder.metadata[key]
        if raw is None:
            return f"{url} does not exist"
        meta = folder.parsed[key] = parse_metadata(raw, url, trust_checkpoint=trust_checkpoint)
        stored = meta.storage_meta
        if stored is None or stored.save_id != save_id:
            return f"{url} was written by another save (save_id {getattr(stored, 'save_id', None)!r}, not {save_id!r})"
        for name in sorted({info.relative_path for info in (meta.storage_data or {}).values()}):
            file_path = posixpath.join(key_folder, name)
            if file_path not in folder.listed and not exists(root, file_path):
                return f"{root.url_of(file_path)}, which {url} names, is missing"
    return None


def claim_iteration(root: Location, iteration: int, save_id: str) -> bool:
    """Create ``iteration``'s claim (``.saving``, holding ``save_id``) if it has none.

    Of saves starting on one clean folder at once, exactly one creates it (a conditional write,
    or inside ``exclusive``); it alone writes torch's fixed data file names, the others put
    their token into theirs, so no two saves write one file. It decides nothing else: the
    commit checks each key's token whoever holds the claim.

    Where the backend cannot make one writer among processes the creator
    (``exclusive_across_processes`` false: GCS, Azure, SFTP today) nobody takes the claim, so every
    save puts its token into its data file names: a racing save can then never replace another's
    data file under one name, and the commit's token check refuses a mix.

    Returns:
        True if this call created the claim.
    """
    backend = root.backend
    if not backend.exclusive_across_processes:
        return False
    path = root.join(layout.format_iteration(iteration), CLAIM_NAME)
    try:
        with backend.exclusive(layout.iteration_path(root, iteration)):
            # Not fsynced: the claim matters only among saves running now. After a crash the
            # folder holds leftovers with it or without it, and the next save takes it over.
            return create_atomically(root, path, save_id.encode(), durable=False)
    except FileNotFoundError:
        return False  # another save is clearing the folder: it is in use, not ours alone


def take_over_iteration(
    root: Location, iteration: int, save_id: str, replacing: CommitRecord | None, *, unpublished: bool = False
) -> None:
    """Make ``iteration``'s folder this save's alone, then delete everything else in it.

    For a folder that holds something: a save's leftovers (it may have died, or be running
    still: nothing tells them apart), or the commit ``replacing`` that the caller decided to
    replace. Before anything is deleted, this save's mark takes the commit record's place, a
    compare-and-swap against what is there (inside ``exclusive(root)``, as a commit is). So of
    this save and one committing the folder at the same moment exactly one wins: a commit that
    landed first is never deleted (this raises), and once the mark is there the other's commit
    (created only if absent) fails. Only this save's commit may replace the mark
    (``commit_record(..., taken_over=True)``); a later save takes over a mark like any leftover.
    ``unpublished``: ``replacing`` is replaced only because the pointer did not name it when the
    caller looked (a save that died between its record and the pointer); it stays if the pointer
    names it now, read under the same lock that a commit holds from its record to its pointer
    (a save that was in between then, running, not dead).

    Raises:
        CheckpointExistsError: another save committed the iteration since the caller looked
            (and it is not ``replacing``); nothing was deleted.
        StorageError: the backend failed; the folder is uncommitted, perhaps half deleted.
    """
    backend = root.backend
    folder = layout.iteration_path(root, iteration)
    path = posixpath.join(folder, COMMIT_RECORD_NAME)
    # A link standing for the folder (or its record) leads elsewhere, perhaps into another run:
    # the link goes, and this save writes a folder of its own.
    backend.remove_link(path, root.path)
    with backend.exclusive(root.path):
        read = backend.read_versioned(path)
        current = _parse_record(root, path, read.data)
        if current is not None and current != replacing and not unfinished_keys(root, iteration, current.keys):
            raised = True
        elif unpublished and current is not None and _published(root, iteration):
            raised = True  # published since the caller looked: a running save's, not a dead one's
        else:
            raised = not backend.replace_if_unchanged(path, _take_over_mark(save_id), read)
            if not raised and unpublished and current is not None and backend.conditional_writes:
                # No lock spans processes here: the save whose record this was may have moved the
                # pointer since, checking its record before our mark (see _still_ours). Then it
                # reported success: put its record back and leave.
                raised = _published(root, iteration) and _give_back(root, path, read.data, save_id)
    if raised:
        raise CheckpointExistsError(
            f"cannot save {root.url_of(folder)}: another process committed it while this save "
            f"started (two processes saving the same iteration into {root.url}); it is left as "
            "committed. Give each run its own save_dirname"
        )
    backend.invalidate(folder)
    entries = [entry for entry in backend.call("ls", folder, detail=False) if entry.rstrip("/") != path]
    backend.remove_trees(entries, within=root.path)
    backend.abort_pending_uploads(folder)
    backend.invalidate(folder)


def _give_back(root: Location, path: str, record: bytes | None, save_id: str) -> bool:
    """Put ``record`` back in place of this save's take-over mark (nothing was deleted yet)."""
    backend = root.backend
    mark = backend.read_versioned(path)
    if record is not None and mark.data == _take_over_mark(save_id):
        backend.replace_if_unchanged(path, record, mark)
    return True


def _published(root: Location, iteration: int) -> bool:
    """Whether the pointer names ``iteration`` or a newer one."""
    latest = read_pointer(root)
    return latest is not None and latest >= iteration


def discard_iteration(root: Location, iteration: int) -> None:
    """Delete ``iteration``'s folder, uncommitting it first (:func:`discard_iterations`)."""
    discard_iterations(root, [iteration])


def discard_iterations(root: Location, iterations: Sequence[int], *, recorded: Sequence[int] | None = None) -> None:
    """Delete the folders of ``iterations``, uncommitting them all first.

    Args:
        recorded: those that may hold a commit record (default: all); the others are
            uncommitted already (the caller's listing showed no record in them).

    Raises:
        StorageError: the backend failed; the folders may be half deleted, but none is
            committed once its files go, so retention retries them at the next save.
    """
    uncommit_iterations(root, iterations if recorded is None else recorded)
    remove_iterations(root, iterations)


def uncommit_iterations(root: Location, iterations: Sequence[int]) -> None:
    """Delete the commit records of ``iterations``, in bulk: from then on no load, listing or
    resume takes them for checkpoints, and retention deletes what is left at a later save.

    Raises:
        StorageError: the backend failed; some may still be committed.
    """
    if iterations:
        records = [posixpath.join(layout.iteration_path(root, i), COMMIT_RECORD_NAME) for i in iterations]
        root.backend.remove_files(records, within=root.path)


def remove_iterations(root: Location, iterations: Sequence[int]) -> None:
    """Delete every file under the folders of ``iterations``, and their unfinished uploads, in
    bulk; call it on uncommitted iterations (:func:`uncommit_iterations`). A symbolic link is
    removed itself, never followed.

    Raises:
        StorageError: the backend failed; the folders may be half deleted.
    """
    if iterations:
        root.backend.remove_trees([layout.iteration_path(root, i) for i in iterations], within=root.path)


def read_pointer(root: Location) -> int | None:
    """The iteration ``latest_checkpoint.txt`` names, or ``None`` when there is no pointer.

    Trailing whitespace and newlines are accepted.

    Raises:
        CorruptCheckpointError: the pointer is empty or does not hold an iteration folder name.
        StorageError: the backend failed.
    """
    return _parse_pointer(root, _read_pointer_file(root).data)


def write_pointer(root: Location, iteration: int) -> bool:
    """Point ``latest_checkpoint.txt`` at ``iteration``, atomically; never move it backwards.

    A compare-and-swap: the pointer is read, and replaced only if it still holds what was read
    (the backend's ``replace_if_unchanged``, inside its ``exclusive`` section: S3 a conditional
    PUT; local disk a lock on the folder; elsewhere a lock in this process). So a writer racing another one re-reads and backs off rather than overwriting a
    newer iteration; and a PUT that landed although its response was lost (then retried and
    refused) is recognised on the re-read.

    Returns:
        True if the pointer now names ``iteration``; False if it names a newer one and was left
        alone.

    Raises:
        CorruptCheckpointError: the pointer holds something other than an iteration name.
        StorageError: the backend failed, or other writers kept changing the pointer.
    """
    data = _pointer_bytes(iteration)
    with root.backend.exclusive(root.path):
        for _ in range(_POINTER_ROUNDS):
            read = _read_pointer_file(root)
            current = _parse_pointer(root, read.data)
            if current is not None and current > iteration:
                logger.warning(
                    "%s names %s, newer than %s; the pointer does not move backwards",
                    pointer_url(root), layout.format_iteration(current), layout.format_iteration(iteration),
                )
                return False
            if current == iteration or _replace_pointer(root, data, read):
                return True
    raise StorageError(
        f"cannot move {pointer_url(root)} to {layout.format_iteration(iteration)}: it changed "
        f"{_POINTER_ROUNDS} times while we tried; is another run saving to {root.url}?"
    )


def _parse_pointer(root: Location, raw: bytes | None) -> int | None:
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


def _pointer_bytes(iteration: int) -> bytes:
    return (layout.format_iteration(iteration) + "\n").encode()


def _read_pointer_file(root: Location) -> Versioned:
    """The pointer's bytes (``None`` if absent) and the version the backend compares against."""
    return root.backend.read_versioned(root.join(POINTER_NAME))


def _replace_pointer(root: Location, data: bytes, read: Versioned) -> bool:
    """Write the pointer if it is still ``read``; False if another write came first."""
    return root.backend.replace_if_unchanged(root.join(POINTER_NAME), data, read)


def create_atomically(root: Location, path: str, data: bytes, *, durable: bool = True) -> bool:
    """Write ``data`` to ``path`` only if nothing is there: a conditional write where the store
    has one, else a read and :func:`write_atomically` (the caller holds ``exclusive``).
    ``durable=False``: on local disk, without the fsyncs that make it survive a power loss.

    Returns:
        True if ``path`` now holds ``data`` because of this call (also when the write landed but
        its answer was lost, and the retry was refused); False if another write came first.
    """
    backend = root.backend
    if backend.conditional_writes and backend.replace_if_unchanged(path, data, Versioned(None)):
        return True
    existing = backend.read_versioned(path).data
    if existing is not None or backend.conditional_writes:
        return existing == data
    write_atomically(root, path, data, durable=durable)
    return True


def write_atomically(root: Location, path: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or the new, never a mix
    (the backend's way: temporary name and rename where there are folders, one PUT elsewhere)."""
    root.backend.write_small_atomic(path, data, fsync=durable)
