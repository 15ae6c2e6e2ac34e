"""Deleting old iterations (``keep_last_n``) without ever failing a save.

The plan is a pure function of what is on storage, so it is easy to reason about: keep the
newest N committed iterations at or below the pointer, the one the pointer names, and any being
written; let go of every other folder older than the pointer. That includes uncommitted folders
older than the pointer: they are debris of failed saves or of earlier deletions that failed
half way (:mod:`~dcp_fsspec.checkpoint.commit.deletion` uncommits first), which is how a failed delete is retried
at the next save without remembering anything between saves.

An incremental run's kept iterations may refer to files of one let go of (:mod:`~dcp_fsspec.checkpoint.commit.referenced`).
Such an iteration is retired, not deleted: a retired mark replaces its commit record, then only
the files no kept iteration refers to go. Its keys' ``.metadata`` and content hashes stay, as a
reader of the references checks them. Once nothing kept refers to it, it is deleted whole.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from functools import partial
from typing import NamedTuple

from dcp_fsspec.checkpoint.commit import deletion, layout, pointer, referenced, run_listing
from dcp_fsspec.checkpoint.commit.at_once import at_once
from dcp_fsspec.checkpoint.commit.run_listing import Listing, Survey
from dcp_fsspec.errors import DcpFsspecError
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, METADATA_NAME, is_content_hashes
from dcp_fsspec.storage.transport.urls import Location

logger = logging.getLogger(__name__)


def plan_deletions(
    iterations: Iterable[int],
    committed: Iterable[int],
    *,
    keep_last_n: int,
    latest: int | None,
    protected: Collection[int] = (),
) -> list[int]:
    """The iterations to delete, ascending.

    Args:
        iterations: every iteration folder under ``save_dirname``, committed or not.
        committed: the committed ones among them.
        keep_last_n: how many committed iterations (at or below ``latest``) to keep, >= 1.
        latest: the iteration the pointer names; nothing is deleted without a pointer.
        protected: iterations never to delete (those being written).
    """
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1, got {keep_last_n}")
    if latest is None:
        return []
    kept = sorted(i for i in committed if i <= latest)[-keep_last_n:]
    keep = set(kept) | {latest} | set(protected)
    return sorted(i for i in set(iterations) if i < latest and i not in keep)


def plan_from_storage(
    root: Location,
    keep_last_n: int,
    *,
    latest: int | None,
    protected: Collection[int] = (),
    survey: Survey | None = None,
    committed_now: int | None = None,
) -> Plan:
    """Every iteration folder under ``root``, and :func:`plan_deletions`' plan for them.

    One listing says which folders exist and which show a commit record; only the newest N
    committed ones matter, so only their records (and those of damaged ones met on the way) are
    read: a bounded number of requests however many folders there are. Where an iteration let go
    of may be referred to (an incremental save's), each kept key's ``.metadata`` is read too.

    Args:
        survey: the listing and records a save read at its start (:class:`Survey`); else read here.
        committed_now: an iteration the caller just committed (newer than ``survey``'s listing).

    Raises:
        CorruptCheckpointError: a commit record it reads is not one we wrote.
        StorageError: the backend failed.
    """
    listed = (
        run_listing.list_save_dirname(root) if survey is None or survey.listing is None else survey.listing
    )
    known = {} if survey is None else dict(survey.committed)  # iteration → committed, as read
    if committed_now is not None:
        known[committed_now] = True
    iterations = sorted(set(listed.folders) | set(known))
    candidates = sorted((i for i in iterations if latest is not None and i <= latest), reverse=True)
    committed: list[int] = []
    # Newest first, as many at once as committed ones are still wanted: the same records a
    # one-by-one scan reads, in one round trip where they are all committed.
    while len(committed) < keep_last_n and candidates:
        batch, candidates = (
            candidates[: keep_last_n - len(committed)],
            candidates[keep_last_n - len(committed) :],
        )
        unknown = [i for i in batch if i not in known]
        records = at_once(
            [partial(run_listing.listed_record, root, listed, iteration) for iteration in unknown],
            one_by_one=root.answers_locally,
        )
        known.update((i, record is not None) for i, record in zip(unknown, records, strict=True))
        committed += [iteration for iteration in batch if known[iteration]]
    delete = plan_deletions(
        iterations, committed, keep_last_n=keep_last_n, latest=latest, protected=protected
    )
    retire = _retirements(root, listed, iterations, delete)
    # A folder the listing shows without a record needs no uncommitting: a failed save's leftovers.
    recorded = [i for i in delete if i not in retire and (i in listed.records or i not in listed.read)]
    return Plan(iterations, delete, recorded, retire)


def _retirements(
    root: Location, listed: Listing, iterations: list[int], delete: list[int]
) -> dict[int, list[str]]:
    """Those of ``delete`` whose files the iterations kept refer to → their files that may go."""
    if not any(referenced.may_be_referred_to(listed, i) for i in delete):
        return {}  # no request, and no torch, for a run without incremental saves
    going = set(delete)
    referred = referenced.referred_files(root, listed, [i for i in iterations if i not in going])
    held = {i: referenced.held_by(root, i, referred) for i in delete}
    return {
        i: [path for path in listed.files.get(i, {}) if path not in files and not _stays(root, i, path)]
        for i, files in held.items()
        if files
    }


def _stays(root: Location, iteration: int, path: str) -> bool:
    """Whether ``path`` is a file a retired iteration keeps whatever refers to it: its mark, and
    each key's ``.metadata`` and content hashes, every rank's (a reader, and a drain's same-save
    check, read them in a folder they refer to)."""
    relative = path[len(layout.iteration_path(root, iteration).rstrip("/")) + 1 :].split("/")
    return relative == [COMMIT_RECORD_NAME] or (
        len(relative) == 2 and (relative[1] == METADATA_NAME or is_content_hashes(relative[1]))
    )


class Plan(NamedTuple):
    """What :func:`plan_from_storage` found and decided.

    Attributes:
        iterations: every iteration folder, ascending.
        delete: the iterations to let go of (:func:`plan_deletions`).
        recorded: those of ``delete`` to delete whole that may hold a commit record (the others
            are uncommitted).
        retire: those of ``delete`` whose files kept iterations refer to → the files to delete
            once each is retired (:func:`~dcp_fsspec.checkpoint.commit.deletion.retire_iterations`).
    """

    iterations: list[int]
    delete: list[int]
    recorded: list[int]
    retire: Mapping[int, list[str]] = {}

    @property
    def whole(self) -> list[int]:
        """Those of ``delete`` to delete whole: no kept iteration refers to their files."""
        return [i for i in self.delete if i not in self.retire]

    def without(self, failed: Collection[int], *, recorded: list[int]) -> Plan:
        """This plan less the ``failed`` iterations, with ``recorded`` still to uncommit."""
        retire = {i: files for i, files in self.retire.items() if i not in failed}
        return Plan(self.iterations, [i for i in self.delete if i not in failed], recorded, retire)


def apply_retention(
    root: Location,
    keep_last_n: int,
    *,
    protected: Collection[int] = (),
    latest: int | None = None,
    purge: BackgroundPurge | None = None,
    survey: Survey | None = None,
    committed_now: int | None = None,
) -> list[int]:
    """Delete what :func:`plan_deletions` says, in bulk; failures are logged, never raised.

    Args:
        root: the ``save_dirname`` location.
        keep_last_n: how many committed iterations to keep, >= 1.
        protected: iterations never to delete (those being written).
        latest: the iteration the pointer names, when the caller just moved it (saves a read);
            ``None``: read the pointer.
        purge: where the files go. The old iterations' commit records are deleted here (up to
            :data:`UNCOMMIT_IN_SAVE` of them: one bulk request), or replaced by retired marks,
            so no load or listing takes them for checkpoints once this returns. Everything
            else, the leftovers of failed saves included, is deleted on ``purge``'s thread,
            while training goes on. ``None``: here.
        survey, committed_now: what the caller read already (see :func:`plan_from_storage`).

    Returns:
        The iterations let go of: deleted or retired (with ``purge``: on their way). One that
        failed is retried at the next call.
    """
    try:
        if latest is None:
            latest = pointer.read_pointer(root)
        plan = plan_from_storage(
            root, keep_last_n, latest=latest, protected=protected, survey=survey, committed_now=committed_now
        )
    except (OSError, DcpFsspecError) as e:
        logger.warning("retention skipped under %s (retried at the next save): %s", root.url, e)
        return []
    if purge is None:
        return _delete(root, plan, keep_last_n)
    # Bounded work in the save: one bulk delete of records, whatever the number of leftovers,
    # and a mark for each iteration kept ones refer to (a few: those that wrote the records).
    now, later = plan.recorded[:UNCOMMIT_IN_SAVE], plan.recorded[UNCOMMIT_IN_SAVE:]
    failed = set(now) - set(_uncommit(root, now)) | set(_retire(root, list(plan.retire)))
    rest = plan.without(failed, recorded=later)
    if rest.delete:
        purge.start(partial(_delete, root, rest, keep_last_n, retired=True))
    return rest.delete


# The most commit records a save deletes itself (S3's DeleteObjects takes 1,000 keys a request);
# the rest are deleted first thing on the purge thread.
UNCOMMIT_IN_SAVE = 1000


class BackgroundPurge:
    """Deletes old iterations' files on a thread of its own, one batch at a time.

    A small save on local disk spent a sixth of its time deleting the iteration retention let
    go (torchtitan's purge thread and Orbax's background delete take it off the save the same
    way). The iteration is uncommitted before the save returns; only its files wait. The owner
    calls :meth:`wait` before its next save (which might write into a folder still being
    deleted) and when it closes. The thread is not a daemon: an interpreter that exits lets it
    finish. A deletion that fails is logged, and retention retries it at the next save.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, remove: Callable[[], object]) -> None:
        """Run ``remove`` on a new thread, once the previous batch is done."""
        self.wait()
        self._thread = threading.Thread(target=_logged(remove), name="dcp-fsspec-purge")
        self._thread.start()

    def wait(self) -> None:
        """Return once the batch in flight (if any) is deleted or has failed (and was logged)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()


def _logged(remove: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        try:
            remove()
        except Exception:  # noqa: BLE001 - nothing else would see it on this thread
            logger.warning("deleting old iterations failed (retried at the next save)", exc_info=True)

    return run


def _delete(root: Location, plan: Plan, keep_last_n: int, *, retired: bool = False) -> list[int]:
    """Carry out ``plan`` (its ``retire`` iterations' marks written already if ``retired``):
    the iterations let go of."""
    failed = let_go(root, plan, retired=retired)
    _warn(root, failed)
    _report(root, plan, failed, keep_last_n)
    return [i for i in plan.delete if i not in failed]


def let_go(root: Location, plan: Plan, *, retired: bool = False) -> dict[int, Exception]:
    """Retire ``plan.retire`` (unless ``retired`` already) and delete their files nobody refers
    to; delete ``plan.whole`` (:func:`discard`). An iteration whose mark failed keeps its files.

    Returns:
        The iterations that failed → why (each tried alone once the bulk request failed).
    """
    failed: dict[int, Exception] = {}
    if not retired:
        _in_bulk(root, deletion.retire_iterations, list(plan.retire), failed)

    def thin(root: Location, iterations: list[int]) -> None:
        deletion.remove_files(root, [path for i in iterations for path in plan.retire[i]])

    _in_bulk(root, thin, [i for i in plan.retire if i not in failed and plan.retire[i]], failed)
    failed.update(discard(root, plan.whole, plan.recorded))
    return failed


def discard(root: Location, iterations: list[int], recorded: list[int]) -> dict[int, Exception]:
    """Delete the folders of ``iterations`` in bulk, uncommitting ``recorded`` (those that may
    hold a commit record) first; a folder whose record stays is left whole.

    Returns:
        The iterations that failed → why (each tried alone once the bulk request failed).
    """
    failed: dict[int, Exception] = {}
    _in_bulk(root, deletion.uncommit_iterations, recorded, failed)
    _in_bulk(root, deletion.remove_iterations, [i for i in iterations if i not in failed], failed)
    return failed


def _uncommit(root: Location, iterations: list[int]) -> list[int]:
    """Delete the records of ``iterations`` in bulk (failures logged): those deleted."""
    failed: dict[int, Exception] = {}
    done = _in_bulk(root, deletion.uncommit_iterations, iterations, failed)
    _warn(root, failed)
    return done


def _retire(root: Location, iterations: list[int]) -> list[int]:
    """Put retired marks in the records' place (failures logged): the iterations that failed."""
    failed: dict[int, Exception] = {}
    _in_bulk(root, deletion.retire_iterations, iterations, failed)
    _warn(root, failed)
    return list(failed)


def _warn(root: Location, failed: dict[int, Exception]) -> None:
    for iteration, error in failed.items():
        logger.warning(
            "could not delete %s under %s (retried at the next save): %s",
            layout.format_iteration(iteration),
            root.url,
            error,
        )


def _in_bulk(
    root: Location,
    delete: Callable[[Location, list[int]], None],
    iterations: list[int],
    failed: dict[int, Exception],
) -> list[int]:
    """``delete`` the ``iterations`` in bulk; if that fails, one at a time, each failure into
    ``failed``: the iterations done."""
    if not iterations:
        return []
    try:
        delete(root, iterations)
        return iterations
    except (OSError, DcpFsspecError) as e:
        if len(iterations) == 1:
            failed[iterations[0]] = e
            return []
    return [i for i in iterations if _in_bulk(root, delete, [i], failed)]


def _report(root: Location, plan: Plan, failed: Collection[int], keep_last_n: int) -> None:
    deleted = [layout.format_iteration(i) for i in plan.whole if i not in failed]
    if deleted:
        logger.info("deleted %s under %s (keep_last_n=%d)", deleted, root.url, keep_last_n)
    # A retired iteration stays in every plan while it is referred to: said when files went.
    retired = [layout.format_iteration(i) for i, files in plan.retire.items() if files and i not in failed]
    if retired:
        logger.info(
            "retired %s under %s (keep_last_n=%d): kept iterations refer to some of their files, "
            "which stay; the others were deleted",
            retired,
            root.url,
            keep_last_n,
        )
