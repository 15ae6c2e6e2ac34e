"""The commit protocol: claiming an iteration's folder, taking it over, committing it, publishing it.

A save prepares its folder (:func:`prepare_iteration`: a claim on a clean one, a take-over mark
on one that holds anything), every rank writes, then rank 0 :func:`publish`\\ es: it writes the
commit record (:mod:`~dcp_fsspec.checkpoint.commit.commit_record`) once every key is this save's, then moves the pointer
(:mod:`~dcp_fsspec.checkpoint.commit.pointer`). A folder left by a crash at any point is never taken for a checkpoint.
Loads check the same rules (:mod:`~dcp_fsspec.checkpoint.commit.loadable`). Reading folders is :mod:`~dcp_fsspec.checkpoint.commit.run_listing`'s; deleting
them is :mod:`~dcp_fsspec.checkpoint.commit.deletion`'s.

This module says *what* must be atomic and in which order; *how* each store does it (a rename,
a conditional PUT, a lock on the folder) is the storage backend's (:mod:`dcp_fsspec.storage.backends`):
``write_small_atomic``, ``read_versioned``, ``replace_if_unchanged`` inside ``exclusive``.
Every storage call is retried by the location's ``RetryPolicy``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from dcp_fsspec.checkpoint.commit import deletion, layout, pointer, run_listing
from dcp_fsspec.checkpoint.commit.at_once import at_once
from dcp_fsspec.checkpoint.commit.commit_record import (
    CommitRecord,
    parse_record,
    read_commit_record,
    record_path,
    take_over_mark,
)
from dcp_fsspec.checkpoint.commit.loadable import first_key_problem
from dcp_fsspec.checkpoint.commit.run_listing import FolderRead, Survey
from dcp_fsspec.errors import CheckpointExistsError, CheckpointNotFoundError
from dcp_fsspec.storage.backends import Versioned
from dcp_fsspec.storage.format.names import METADATA_NAME
from dcp_fsspec.storage.transport.urls import Location

logger = logging.getLogger(__name__)

# In an iteration folder: which save claimed it first, clean (its token). It stays after the
# commit (removing it would cost a request per save), so its name says what it holds, not
# that a save is in progress.
CLAIM_NAME = ".claimed_by"
# The same claim as earlier versions named it: older runs' folders hold it; nothing reads it.
LEGACY_CLAIM_NAME = ".saving"


class Prepared(NamedTuple):
    """What rank 0's preparation of an iteration's folder hands every rank.

    Attributes:
        save_id: the save's token.
        claimed: the folder was clean and this save claimed it first: it writes torch's data
            file names (else names holding the token).
        taken_over: the folder held something and this save's mark now stands in its commit
            record's place (see :func:`take_over_iteration`).
        base: an incremental save's base: the iteration the pointer named, when older than
            this one, with the keys its record lists (``None``: none, or not incremental).
    """

    save_id: str
    claimed: bool
    taken_over: bool
    base: CommitRecord | None = None


def prepare_iteration(
    root: Location,
    iteration: int,
    save_id: str,
    *,
    overwrite: bool = False,
    keep_last_n: int | None = None,
    incremental: bool = False,
) -> tuple[Prepared, Survey | None]:
    """Rank 0, first in a save: make ``iteration``'s folder this save's.

    A clean folder is claimed (:func:`claim_iteration`). One that holds anything is taken over
    and cleared (:func:`take_over_iteration`): a failed save's leftovers, a running save's files,
    or a commit the caller may replace. Its own questions (the pointer, the iteration's record,
    its folder) go out at once, in one round trip.

    Args:
        root: the ``save_dirname`` location.
        iteration: the iteration to save.
        save_id: the save's token.
        overwrite: a committed ``iteration``, or one older than the pointer, may be replaced.
        keep_last_n: retention's, if any: then ``save_dirname``'s listing and the records
            retention will want are read beside the questions above (the returned :class:`Survey`).
        incremental: the base's record is read beside the claim (:attr:`Prepared.base`).

    Returns:
        What every rank needs, and what retention needs (``None`` without ``keep_last_n``).

    Raises:
        CheckpointExistsError: ``iteration`` is committed, or the pointer names a newer one, and
            not ``overwrite``; or another save committed it meanwhile.
        StorageError: the backend failed.
    """
    folder_path = layout.iteration_path(root, iteration)
    latest, record, present, *surveyed = at_once(
        [
            partial(pointer.read_pointer, root),
            partial(read_commit_record, root, iteration),
            partial(run_listing.folder_exists, root, folder_path),
            *([Survey.listing_read(root)] if keep_last_n is not None else []),
        ],
        one_by_one=root.answers_locally,
    )
    survey = surveyed[0] if surveyed else None
    record, taken_over, unpublished = _what_is_there(
        root, iteration, latest, record, present, overwrite=overwrite
    )
    take: Callable[[], bool | None]
    if taken_over:
        take = partial(
            take_over_iteration, root, iteration, save_id, replacing=record, unpublished=unpublished
        )
    else:
        take = partial(claim_iteration, root, iteration, save_id)
    # Beside it, the records retention will want (other folders: independent of this one).
    reads = [] if survey is None or keep_last_n is None else survey.record_reads(root, keep_last_n, iteration)
    has_base = incremental and latest is not None and latest < iteration
    base_read = [partial(read_commit_record, root, latest)] if has_base else []
    claimed, *answers = at_once([take, *base_read, *reads], one_by_one=root.answers_locally)
    base = answers[0] if has_base else None
    return Prepared(save_id, claimed=bool(claimed), taken_over=taken_over, base=base), survey


def _what_is_there(
    root: Location,
    iteration: int,
    latest: int | None,
    record: CommitRecord | None,
    present: bool,
    *,
    overwrite: bool,
) -> tuple[CommitRecord | None, bool, bool]:
    """Whether the save may go on in ``iteration``'s folder, said and logged.

    Returns:
        The folder's commit record, whether the folder must be taken over (it holds anything),
        and whether that record is unpublished (its save died before moving the pointer) and
        may be replaced as such.

    Raises:
        CheckpointExistsError: see :func:`prepare_iteration`.
    """
    folder = root.url_of(layout.iteration_path(root, iteration))
    if latest is not None and latest > iteration and not overwrite:
        raise CheckpointExistsError(
            f"cannot save {folder}: {pointer.pointer_url(root)} already names the newer "
            f"{layout.format_iteration(latest)} and never moves backwards; save a later iteration, use "
            "a new save_dirname, or pass overwrite=True to write it anyway (the pointer stays)"
        )
    record, reason = run_listing.judge_iteration(root, iteration, record, present)
    # Committed but newer than the pointer: its save died between the commit record and the
    # pointer, so nothing names it; the resumed run replaces it like any leftover.
    unpublished = record is not None and (latest is None or latest < iteration)
    if record is not None and not overwrite and not unpublished:
        raise CheckpointExistsError(
            f"{folder} is already a committed checkpoint; save a different iteration, or pass "
            "overwrite=True to replace it"
        )
    if unpublished:
        logger.info("replacing %s, committed by a save that died before moving the pointer", folder)
    elif record is not None:
        logger.warning("overwriting the committed checkpoint %s", folder)
    elif reason != "does not exist":
        logger.info("clearing %s, left by a save that never committed (%s)", folder, reason)
    taken_over = record is not None or reason != "does not exist"
    return record, taken_over, unpublished and not overwrite  # replaced only if still unpublished


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
        read, *found = at_once(
            [partial(pointer.read_pointer_file, root), *run_listing.folder_reads(root, iteration, keys)],
            one_by_one=root.answers_locally,
        )
        current = pointer.parse_pointer(root, read.data)
        if current is not None and current > iteration and not behind_pointer:
            raise _moved_past(root, iteration, current)
        commit_record(
            root,
            iteration,
            keys,
            world_size,
            save_id,
            taken_over=taken_over,
            folder=run_listing.folder_read(found, keys),
        )
        if current is not None and current >= iteration:
            latest = current
        elif pointer.replace_pointer(root, iteration, read):
            latest = iteration
        else:
            latest = None
    if latest is None:
        # Another writer changed the pointer between our read and our write: the full loop decides.
        latest = pointer.move_after_lost_race(root, iteration)
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


def _moved_past(root: Location, iteration: int, latest: int) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"cannot commit {root.url_of(layout.iteration_path(root, iteration))}: {pointer.pointer_url(root)} "
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
    folder = run_listing.read_folder(root, iteration, keys) if folder is None else folder
    folder_url = root.url_of(layout.iteration_path(root, iteration))
    for key in folder.unfinished(keys):
        url = root.url_of(layout.key_path(root, iteration, key))
        raise CheckpointNotFoundError(
            f"cannot commit {folder_url}: key {key!r} at {url} has no {METADATA_NAME}, so its save "
            "did not finish; save the iteration again"
        )
    problem = None if save_id is None else first_key_problem(root, iteration, keys, save_id, folder)
    if problem is not None:
        raise CheckpointExistsError(
            f"cannot commit {folder_url}: {problem}, so another process is saving the same "
            f"iteration into {root.url} (a restarted job racing the old one, or two jobs with "
            "one save_dirname); this save is not committed. Give each run its own save_dirname"
        )
    record = CommitRecord(iteration, tuple(keys), world_size, time.time(), save_id)
    path = record_path(root, iteration)
    if taken_over and save_id is not None:
        # Our mark must still be there: another save that took the folder over since replaced it.
        read = root.backend.read_versioned(path)
        created = read.data == take_over_mark(save_id) and root.backend.replace_if_unchanged(
            path, record.to_json(), read
        )
    else:
        created = create_atomically(root, path, record.to_json())
    if not created:
        raise CheckpointExistsError(
            f"cannot commit {folder_url}: another process committed it, or took it over, while this "
            f"save wrote it (two processes saving the same iteration into {root.url}); this save is "
            "not committed. Give each run its own save_dirname"
        )
    return record


def claim_iteration(root: Location, iteration: int, save_id: str) -> bool:
    """Create ``iteration``'s claim (``.claimed_by``, holding ``save_id``) if it has none.

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
    path = record_path(root, iteration)
    deletion.remove_link(root, iteration)  # this save writes a folder of its own
    with backend.exclusive(root.path):
        read = backend.read_versioned(path)
        current = parse_record(root, path, read.data)
        if (
            current is not None
            and current != replacing
            and not run_listing.unfinished_keys(root, iteration, current.keys)
        ):
            raised = True
        elif unpublished and current is not None and _published(root, iteration):
            raised = True  # published since the caller looked: a running save's, not a dead one's
        else:
            raised = not backend.replace_if_unchanged(path, take_over_mark(save_id), read)
            if not raised and unpublished and current is not None and backend.conditional_writes:
                # No lock spans processes here: the save whose record this was may have moved the
                # pointer since, checking its record before our mark (see _still_ours). Then it
                # reported success: put its record back and leave.
                raised = _published(root, iteration) and _give_back(root, path, read.data, save_id)
    if raised:
        raise CheckpointExistsError(
            f"cannot save {root.url_of(layout.iteration_path(root, iteration))}: another process committed it while this save "
            f"started (two processes saving the same iteration into {root.url}); it is left as "
            "committed. Give each run its own save_dirname"
        )
    deletion.clear_folder(root, iteration, keep=path)


def _give_back(root: Location, path: str, record: bytes | None, save_id: str) -> bool:
    """Put ``record`` back in place of this save's take-over mark (nothing was deleted yet)."""
    backend = root.backend
    mark = backend.read_versioned(path)
    if record is not None and mark.data == take_over_mark(save_id):
        backend.replace_if_unchanged(path, record, mark)
    return True


def _published(root: Location, iteration: int) -> bool:
    """Whether the pointer names ``iteration`` or a newer one."""
    latest = pointer.read_pointer(root)
    return latest is not None and latest >= iteration


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
