"""The drain: copying locally committed iterations to the durable ``save_dirname``, one at a time.

With a local tier a save commits under its ``dirname`` first; then every rank's :class:`Drainer`
does, in a background thread that runs no collective:

1. Each rank copies the files of that iteration it wrote (rank 0 also every ``.metadata`` and any
   file no other rank owns), by concurrent uploads, without re-serialising anything.
2. Each rank ``r > 0`` writes a marker, ``.drained.{r}`` holding the save's token, into the
   durable iteration folder. Rank 0 waits for every marker, bounded in time.
3. Rank 0 copies the ``.metadata`` files last and commits the iteration with the rules of a
   direct save (:func:`.commit.publish`), then removes the markers.

Only a committed local iteration is copied. Of an incremental run, only the iteration's own
files go up where ``save_dirname`` holds every iteration it refers to (:mod:`.durable_bases`);
the records of any other reference are copied in, as ``cp`` does (:mod:`..storage.self_contained`),
so the durable copy never refers to what the durable tier lacks. With per-node local disks (see :mod:`.tiers`) each
rank uploads its data files renamed ``__{rank}_*`` and its share of each ``.metadata``; rank 0
merges them into one global ``.metadata`` per key (:mod:`.merge`). The durable copy is a plain
checkpoint either way.

Saves faster than drains follow the policy: ``"every"`` makes the next submit wait for the
drain in flight; ``"latest"`` drops waiting iterations (the same on every rank: see
:meth:`Drainer.paused`). A failed drain does not stop training: the next :meth:`Drainer.submit`
returns its error (the caller warns) and :meth:`Drainer.wait` raises it, until a drain succeeds.
"""

from __future__ import annotations

import logging
import pickle
import posixpath
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import DcpFsspecError, DrainError
from ..storage.copying import DATA, check_inside, copy_files, list_files, phase_of
from ..storage.decoding import parse_metadata
from ..storage.names import COMMIT_RECORD_NAME, METADATA_NAME
from ..storage.copying import Piece, pieces_bytes
from ..storage.self_contained import self_contained_files
from ..storage.urls import Location
from . import commit, deletion, layout, listing, pointer, retention
from .durable_bases import DurableBases
from .events import CheckpointEvent
from .merge import merge_metadata, rank_file_name
from .options import DRAIN_EVERY, DRAIN_POLICIES
from .record import CommitRecord

logger = logging.getLogger(__name__)

# Not copied: the durable commit writes its own record, and the claim belongs to the local save.
_NOT_COPIED = frozenset({COMMIT_RECORD_NAME, commit.CLAIM_NAME})
# A rank's data files, plain or with the save's token (storage/writer.py: ``_prefix``).
_DATA_FILE = re.compile(r"__(\d+)_.*\.distcp")
MARKER_PREFIX = ".drained."
# How long rank 0 waits for the other ranks' markers after its own copy, without a retry deadline.
_MARKER_WAIT_SECONDS = 600.0


def marker_name(rank: int) -> str:
    """The file rank ``rank`` (> 0) writes into the durable iteration folder once its files are there."""
    return f"{MARKER_PREFIX}{rank}"


def metadata_part_name(rank: int) -> str:
    """What rank ``rank`` (> 0, per-node mode) uploads its ``.metadata`` of a key as, into the key's folder."""
    return f"{MARKER_PREFIX}{rank}{METADATA_NAME}"


def owner_of(name: str, world_size: int) -> int:
    """The rank that copies ``name``: the rank in a data file's name, else (``.metadata`` and
    anything else) rank 0, which also takes a data file naming a rank outside the world."""
    match = _DATA_FILE.fullmatch(posixpath.basename(name))
    rank = int(match.group(1)) if match else 0
    return rank if rank < world_size else 0


@dataclass(frozen=True)
class DrainJob:
    """One iteration to drain, as every rank sees it.

    Attributes:
        iteration: committed under ``local_dirname`` (rank 0 read its commit record).
        token: the save's token from that record: what the markers hold (``""`` for a record
            written before tokens existed).
    """

    iteration: int
    token: str


def drain_iteration(
    local: Location,
    durable: Location,
    job: DrainJob,
    *,
    rank: int = 0,
    world_size: int = 1,
    keep_last_n: int | None,
    marker_wait: float = _MARKER_WAIT_SECONDS,
    workers: int = 8,
    per_node: bool = False,
) -> tuple[tuple[str, ...], int]:
    """Copy this rank's files of the committed local ``job.iteration`` to ``durable``; on rank 0,
    wait for the other ranks' markers, commit it there and apply retention.

    Args:
        local: this rank's ``local_dirname`` location.
        durable: the ``save_dirname`` location.
        job: the iteration and its save's token.
        rank: this rank; world_size: how many ranks drain it.
        keep_last_n: the durable tier's retention; ``None`` keeps everything.
        marker_wait: seconds rank 0 waits for the other ranks' markers once its own files are copied.
        workers: files copied at once.
        per_node: ``local`` is this rank's own checkpoint of its share (see the module docstring).

    Returns:
        The keys of the iteration (rank 0; ``()`` on other ranks) and the file bytes this rank
        copied (0 when nothing needed copying).

    Raises:
        DrainError: the local iteration is not committed, copying or committing failed, or a
            rank's marker did not come in time; the durable pointer did not move. The message
            names both folders.
    """
    iteration = job.iteration
    src = local.url_of(layout.iteration_path(local, iteration))
    dst = durable.url_of(layout.iteration_path(durable, iteration))
    try:
        latest = pointer.read_pointer(durable)
        if latest is not None and latest >= iteration:
            if latest > iteration:
                logger.info("not draining %s: %s already names the newer %s", src, pointer.pointer_url(durable),
                            layout.format_iteration(latest))  # fmt: skip
            return (), 0
        deletion.remove_link(durable, iteration)  # before any write: a link there leads elsewhere
        if rank != 0:
            return (), _copy_and_mark(local, durable, job, rank, world_size, workers, per_node)
        return _drain_and_commit(local, durable, job, world_size, keep_last_n, marker_wait, workers, per_node)
    except DrainError:
        raise
    except (OSError, DcpFsspecError) as e:
        raise DrainError(
            f"could not copy {src} to the durable tier {dst}: {e}; the pointer {pointer.pointer_url(durable)} "
            "stays on its previous iteration, the local copy is kept, and the next save drains again"
        ) from e


def _copy_and_mark(
    local: Location, durable: Location, job: DrainJob, rank: int, world_size: int, workers: int, per_node: bool
) -> int:
    """A rank other than 0: copy its files, then leave its marker for rank 0; the bytes copied."""
    iteration = job.iteration
    if per_node:
        keys = _require_committed_locally(local, durable, iteration, job.token).keys
        assembled, written = _self_contained(local, durable, iteration, rank)
        nbytes = _copy_rank_data(local, durable, iteration, rank, workers, assembled)
        _upload_metadata_parts(local, durable, iteration, rank, keys, written)
    else:
        nbytes = _copy_own(local, durable, iteration, rank, world_size, lambda name: True, workers)
    durable.backend.write_small_atomic(durable.join(layout.format_iteration(iteration), marker_name(rank)),
                                       job.token.encode())  # fmt: skip
    logger.debug("copied rank %d's files of %s to %s", rank, local.url_of(layout.iteration_path(local, iteration)),
                 durable.url_of(layout.iteration_path(durable, iteration)))  # fmt: skip
    return nbytes


def _require_committed_locally(
    local: Location, durable: Location, iteration: int, token: str | None = None
) -> CommitRecord:
    """The local commit record of ``iteration`` (per node, of the save ``token``: every rank's
    copy is one save).

    Raises:
        DrainError: the local copy is not committed (or is another save's); naming both folders.
    """
    record, why = listing.inspect_iteration(local, iteration)
    if record is not None and token is not None and record.save_id != token:
        why = f"is another save's (save_id {record.save_id!r}, not rank 0's {token!r})"
        record = None
    if record is None:
        raise DrainError(
            f"not copying {local.url_of(layout.iteration_path(local, iteration))} to "
            f"{durable.url_of(layout.iteration_path(durable, iteration))}: the local copy {why}, and a durable "
            "copy is only made of a committed one; save the iteration again"
        )
    return record


def _drain_and_commit(
    local: Location, durable: Location, job: DrainJob, world_size: int, keep_last_n: int | None,
    marker_wait: float, workers: int, per_node: bool,
) -> tuple[tuple[str, ...], int]:  # fmt: skip
    """Rank 0's part of :func:`drain_iteration`, after the pointer check."""
    iteration = job.iteration
    src = local.url_of(layout.iteration_path(local, iteration))
    dst = durable.url_of(layout.iteration_path(durable, iteration))
    record = _require_committed_locally(local, durable, iteration)
    durable_record, reason = listing.inspect_iteration(durable, iteration)
    if durable_record is not None and durable_record.save_id == record.save_id:
        # Committed by a drain that died before moving the pointer.
        latest = iteration if pointer.write_pointer(durable, iteration) else pointer.read_pointer(durable)
        logger.info("committed %s (the durable copy of %s)", dst, src)
        _remove_markers(durable, iteration, world_size, record.keys if per_node else ())
        _apply_retention(durable, keep_last_n, iteration, latest)
        return record.keys, 0
    if durable_record is not None or reason != "does not exist":
        # Not discarded whole: the other ranks may be copying into it now. Uncommitting it is
        # enough; every file this save names is written again, and .metadata last.
        logger.info("overwriting %s, left by a drain that never finished (%s)", dst,
                    "another save's commit" if durable_record is not None else reason)  # fmt: skip
        if durable_record is not None:
            deletion.uncommit_iterations(durable, [iteration])
    logger.info("draining %s to %s", src, dst)
    if per_node:
        assembled, written = _self_contained(local, durable, iteration, 0)
        nbytes = _copy_rank_data(local, durable, iteration, 0, workers, assembled)
        _wait_for_markers(durable, job, world_size, marker_wait)
        nbytes += _write_merged_metadata(local, durable, job, record.keys, world_size, written)
    else:
        assembled, written = _self_contained(local, durable, iteration, None)
        nbytes = _copy_own(local, durable, iteration, 0, world_size, lambda name: phase_of(name) == DATA, workers,
                           assembled=assembled)  # fmt: skip
        _wait_for_markers(durable, job, world_size, marker_wait)
        nbytes += _copy_own(local, durable, iteration, 0, world_size, lambda name: phase_of(name) != DATA, workers,
                            written=written)  # fmt: skip
    logger.debug("copied %s to %s; committing it there", src, dst)
    # Per node, every rank saved alone: the durable copy is one save of world_size ranks, with rank 0's token.
    writers = world_size if per_node else record.world_size
    latest = commit.publish(durable, iteration, record.keys, writers, save_id=job.token if per_node else record.save_id)
    logger.info("committed %s (the durable copy of %s)", dst, src)
    _remove_markers(durable, iteration, world_size, record.keys if per_node else ())
    _apply_retention(durable, keep_last_n, iteration, latest)
    return record.keys, nbytes


def _self_contained(
    local: Location, durable: Location, iteration: int, rank: int | None
) -> tuple[dict[str, list[Piece]], dict[str, bytes]]:
    """The records of ``iteration``'s references that ``durable`` lacks, to copy in, and each
    ``.metadata`` rewritten to name them (``rank``: per node, this rank's copy; else ``None``)."""
    files = list_files(local, layout.iteration_path(local, iteration))
    rename = None if rank is None else (lambda name: rank_file_name(name, rank))
    bases = DurableBases(local, durable, rename)
    # Per node, the new files are named as rank 0's data files are, so that rank_file_name renames them.
    return self_contained_files(local, files, keep=bases.holds, prefix="__ref_" if rank is None else "__0_ref_")


def _copy_own(
    local: Location, durable: Location, iteration: int, rank: int, world_size: int,
    which: Callable[[str], bool], workers: int, *,
    assembled: Mapping[str, list[Piece]] | None = None, written: Mapping[str, bytes] | None = None,
) -> int:  # fmt: skip
    """Copy the files of ``iteration`` that ``rank`` owns and ``which`` accepts (``written`` in
    place of the listed files of its names), and ``assembled``; return their bytes."""
    files = {
        name: size
        for name, size in list_files(local, layout.iteration_path(local, iteration)).items()
        if posixpath.basename(name) not in _NOT_COPIED and owner_of(name, world_size) == rank and which(name)
        and name not in (written or {})
    }  # fmt: skip
    check_inside(local, files)
    nbytes = sum(files.values()) + pieces_bytes(assembled or {}) + sum(map(len, (written or {}).values()))
    logger.debug("rank %d copies %d files (%.1f MiB) of %s", rank, len(files), nbytes / 2**20,
                 layout.format_iteration(iteration))  # fmt: skip
    copy_files(local, durable, files, workers=workers, assembled=assembled, written=written)
    return nbytes


def _copy_rank_data(
    local: Location, durable: Location, iteration: int, rank: int, workers: int, assembled: Mapping[str, list[Piece]]
) -> int:
    """Per node: copy this rank's data files of ``iteration``, and ``assembled``, renamed as
    ``rank``'s; return their bytes."""
    files = {
        name: size
        for name, size in list_files(local, layout.iteration_path(local, iteration)).items()
        if posixpath.basename(name) not in _NOT_COPIED and phase_of(name) == DATA
    }
    check_inside(local, files)
    copy_files(local, durable, files, workers=workers, rename=lambda name: rank_file_name(name, rank),
               assembled=assembled)  # fmt: skip
    return sum(files.values()) + pieces_bytes(assembled)


def _local_metadata(local: Location, iteration: int, key: str, written: Mapping[str, bytes]) -> tuple[str, bytes]:
    """The path and bytes of a key's local ``.metadata``, or of its self-contained rewrite in ``written``."""
    path = posixpath.join(layout.key_path(local, iteration, key), METADATA_NAME)
    name = posixpath.join(layout.format_iteration(iteration), key, METADATA_NAME)
    return path, written[name] if name in written else local.backend.call("cat_file", path)


def _upload_metadata_parts(
    local: Location, durable: Location, iteration: int, rank: int, keys: tuple[str, ...], written: Mapping[str, bytes]
) -> None:
    """Per node, rank > 0: each key's local ``.metadata``, for rank 0 to merge (before the marker)."""
    for key in keys:
        _, data = _local_metadata(local, iteration, key, written)
        durable.backend.write_small_atomic(
            posixpath.join(layout.key_path(durable, iteration, key), metadata_part_name(rank)), data
        )


def _write_merged_metadata(
    local: Location, durable: Location, job: DrainJob, keys: tuple[str, ...], world_size: int,
    written: Mapping[str, bytes],
) -> int:  # fmt: skip
    """Per node, rank 0: each key's global ``.metadata``, merged from every rank's; return its bytes."""
    nbytes = 0
    for key in keys:
        own, data = _local_metadata(local, job.iteration, key, written)
        folder = layout.key_path(durable, job.iteration, key)
        parts = [(0, parse_metadata(data, local.url_of(own)))]
        for rank in range(1, world_size):
            path = posixpath.join(folder, metadata_part_name(rank))
            parts.append((rank, parse_metadata(durable.backend.call("cat_file", path), durable.url_of(path))))
        try:
            merged = merge_metadata(
                parts, rename=rank_file_name, save_id=job.token, checkpoint_id=durable.url_of(folder)
            )
        except ValueError as e:
            raise DrainError(f"cannot merge the ranks' copies of key {key!r} into {durable.url_of(folder)}: {e}") from e
        data = pickle.dumps(merged)
        durable.backend.write_small_atomic(posixpath.join(folder, METADATA_NAME), data)
        nbytes += len(data)
    return nbytes


def _wait_for_markers(durable: Location, job: DrainJob, world_size: int, seconds: float) -> None:
    """Block until every rank > 0 wrote its marker holding ``job.token``.

    Raises:
        DrainError: ``seconds`` passed first; the message names the ranks still missing.
    """
    folder = layout.format_iteration(job.iteration)
    missing = set(range(1, world_size))
    deadline, pause = time.monotonic() + seconds, 0.02
    while True:
        for rank in sorted(missing):
            data = durable.backend.read_versioned(durable.join(folder, marker_name(rank))).data
            if data is not None and data == job.token.encode():
                missing.discard(rank)
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise DrainError(
                f"not committing {durable.url_of(durable.join(folder))}: rank(s) {sorted(missing)} did not copy "
                f"their files of it within {seconds:.0f} s (no {marker_name(min(missing))} holding this save's "
                "token); see those ranks' logs for their drain's error. The pointer stays, and the next save "
                "drains again"
            )
        time.sleep(pause)
        pause = min(1.0, pause * 2)


def _remove_markers(durable: Location, iteration: int, world_size: int, keys: tuple[str, ...]) -> None:
    """Delete the markers of a committed iteration, and the ``.metadata`` parts of its ``keys``
    (per node); one left behind is harmless (logged)."""
    paths = [durable.join(layout.format_iteration(iteration), marker_name(rank)) for rank in range(1, world_size)]
    paths += [
        posixpath.join(layout.key_path(durable, iteration, key), metadata_part_name(rank))
        for key in keys
        for rank in range(1, world_size)
    ]
    try:
        durable.backend.remove_files(paths, within=durable.path)  # in bulk, never through a link
    except (OSError, DcpFsspecError) as e:
        folder = durable.url_of(layout.iteration_path(durable, iteration))
        logger.info("could not remove the markers in %s (harmless): %s", folder, e)


def _apply_retention(durable: Location, keep_last_n: int | None, iteration: int, latest: int | None) -> None:
    if keep_last_n is not None:
        retention.apply_retention(durable, keep_last_n, protected=(iteration,), latest=latest)


class Drainer:
    """One background thread that drains iterations on this rank, one at a time, under a policy.

    Every rank has one and is handed the same jobs in the same order; the thread runs no
    collective (see the module docstring).

    Args:
        local: this rank's ``local_dirname`` location.
        durable: the ``save_dirname`` location.
        policy: :data:`DRAIN_EVERY` or :data:`DRAIN_LATEST`.
        keep_last_n: the durable tier's retention.
        on_end: called (in the drain thread, on rank 0) with a ``drain_end`` event after each drain.
        rank, world_size: this rank, and how many ranks drain each iteration.
        marker_wait, per_node: see :func:`drain_iteration`.
    """

    def __init__(
        self,
        local: Location,
        durable: Location,
        *,
        policy: str,
        keep_last_n: int | None,
        on_end: Callable[[CheckpointEvent], None],
        rank: int = 0,
        world_size: int = 1,
        marker_wait: float = _MARKER_WAIT_SECONDS,
        per_node: bool = False,
    ) -> None:
        if policy not in DRAIN_POLICIES:
            raise ValueError(f"drain={policy!r} is not supported; choose one of {list(DRAIN_POLICIES)}")
        self._local = local
        self._durable = durable
        self.policy = policy
        self._keep_last_n = keep_last_n
        self._on_end = on_end
        self._rank = rank
        self._world_size = world_size
        self._marker_wait = marker_wait
        self._per_node = per_node
        self._cond = threading.Condition()
        self._running: int | None = None
        self._waiting: list[DrainJob] = []
        self._paused = False
        self._thread: threading.Thread | None = None
        self._error: DrainError | None = None

    @contextmanager
    def paused(self) -> Iterator[list[int]]:
        """Start no waiting job while inside; yields the waiting iterations.

        The caller agrees with the other ranks which waiting iterations to drop (only those no
        rank has started: rank 0 would wait for markers that never come) and passes them to
        :meth:`submit` before leaving.
        """
        with self._cond:
            self._paused = True
            waiting = [job.iteration for job in self._waiting]
        try:
            yield waiting
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def submit(self, job: DrainJob, *, drop: Collection[int] = ()) -> DrainError | None:
        """Drain ``job`` after the drain in flight; with :data:`DRAIN_EVERY` first wait for it.

        Args:
            job: the iteration committed locally, and its token.
            drop: waiting iterations that go up no more (:data:`DRAIN_LATEST`; logged).

        Returns:
            The error of the last finished drain if it failed (the durable tier is behind).
        """
        with self._cond:
            if self.policy == DRAIN_EVERY:
                self._cond.wait_for(lambda: self._running is None and not self._waiting)
            failure = self._error
            dropped = [j.iteration for j in self._waiting if j.iteration in drop]
            self._waiting = [j for j in self._waiting if j.iteration not in drop] + [job]
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="dcp-fsspec-drain", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if dropped and self._rank == 0:
            logger.info(
                "drain='latest': %s is replaced by %s before being copied to %s (a drain was in flight)",
                ", ".join(map(layout.format_iteration, dropped)), layout.format_iteration(job.iteration),
                self._durable.url,
            )  # fmt: skip
        return failure

    def undrained(self) -> set[int]:
        """The iterations in flight or waiting: local retention must keep them."""
        with self._cond:
            return {j.iteration for j in self._waiting} | ({self._running} if self._running is not None else set())

    def wait(self, timeout: float | None = None) -> None:
        """Block until no drain is in flight or waiting; raise the last drain's error, if it failed.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            DrainError: the last drain failed: the durable tier is behind the local one.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._running is None and not self._waiting, timeout):
                raise TimeoutError(
                    f"the drain of {layout.format_iteration(self._running or 0)} to {self._durable.url} did not "
                    f"finish within {timeout} s; it goes on in the background"
                )
            if self._error is not None:
                raise self._error

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._paused)
                if not self._waiting:
                    self._thread = None
                    self._cond.notify_all()
                    return
                job = self._waiting.pop(0)
                self._running = job.iteration
            error = self._drain(job)
            with self._cond:
                self._running = None
                # A later drain that succeeds brings the durable tier up to date: the failure is over.
                self._error = error
                self._cond.notify_all()

    def _drain(self, job: DrainJob) -> DrainError | None:
        """Drain one job; report it (rank 0); return its error."""
        error: DrainError | None = None
        keys: tuple[str, ...] = ()
        nbytes, start = 0, time.perf_counter()
        try:
            keys, nbytes = drain_iteration(
                self._local, self._durable, job, rank=self._rank, world_size=self._world_size,
                keep_last_n=self._keep_last_n, marker_wait=self._marker_wait, per_node=self._per_node,
            )  # fmt: skip
        except DrainError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - kept and raised by wait(), like any drain failure
            error = DrainError(
                f"draining {layout.format_iteration(job.iteration)} to {self._durable.url} failed: {e!r}"
            )
        if error is not None:
            logger.warning("%s", error)
        if self._rank != 0:
            return error
        url = self._durable.url_of(layout.iteration_path(self._durable, job.iteration))
        event = CheckpointEvent(
            "drain_end", job.iteration, url, keys, nbytes, time.perf_counter() - start, tier="durable",
            error=None if error is None else str(error),
        )  # fmt: skip
        try:
            self._on_end(event)  # before wait() returns, so a caller that waited has seen it
        except Exception as e:  # noqa: BLE001 - a callback's bug must not stop the drains
            logger.warning("the on_drain_end callback failed for %s: %r", url, e)
        return error
