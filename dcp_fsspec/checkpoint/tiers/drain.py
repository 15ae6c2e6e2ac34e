"""The drain: copying locally committed iterations to the durable ``save_dirname``, one at a time.

With a local tier a save commits under its ``dirname`` first; then every rank's drain thread
(:class:`~dcp_fsspec.checkpoint.tiers.drain_thread.Drainer`) does, running no collective:

1. Each rank copies the files of that iteration it wrote (rank 0 also every ``.metadata`` and any
   file no other rank owns), by concurrent uploads, without re-serialising anything.
2. Each rank ``r > 0`` writes a marker, ``.drained.{r}`` holding the save's token, into the
   durable iteration folder. Rank 0 waits for every marker, bounded in time.
3. Rank 0 copies the ``.metadata`` files last and commits the iteration with the rules of a
   direct save (:func:`~dcp_fsspec.checkpoint.commit.committing.publish`), then removes the markers.

Only a committed local iteration is copied. Of an incremental run, only the iteration's own
files go up where ``save_dirname`` holds every iteration it refers to (:mod:`~dcp_fsspec.checkpoint.tiers.durable_bases`);
the records of any other reference are copied in, as ``cp`` does (:mod:`~dcp_fsspec.storage.checkpoint_files.self_contained`),
so the durable copy never refers to what the durable tier lacks. With per-node local disks (see :mod:`~dcp_fsspec.checkpoint.tiers.tiered`) each
rank uploads its data files renamed ``__{rank}_*`` and its share of each ``.metadata``; rank 0
merges them into one global ``.metadata`` per key (:mod:`~dcp_fsspec.checkpoint.tiers.metadata_merge`). The durable copy is a plain
checkpoint either way.

Each rank's drain thread, and its policy when saves outrun drains: :mod:`~dcp_fsspec.checkpoint.tiers.drain_thread`.
"""

from __future__ import annotations

import logging
import pickle
import posixpath
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dcp_fsspec.checkpoint.commit import committing, deletion, layout, pointer, retention, run_listing
from dcp_fsspec.checkpoint.commit.commit_record import CommitRecord
from dcp_fsspec.checkpoint.tiers.durable_bases import DurableBases
from dcp_fsspec.checkpoint.tiers.metadata_merge import merge_metadata, rank_file_name
from dcp_fsspec.errors import DcpFsspecError, DrainError
from dcp_fsspec.storage.checkpoint_files.copying import (
    DATA,
    Piece,
    check_inside,
    copy_files,
    list_files,
    phase_of,
    pieces_bytes,
)
from dcp_fsspec.storage.checkpoint_files.self_contained import self_contained_files
from dcp_fsspec.storage.format.metadata_file import parse_metadata
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, METADATA_NAME
from dcp_fsspec.storage.transport.urls import Location

logger = logging.getLogger(__name__)

# Not copied: the durable commit writes its own record, and the claim belongs to the local save.
_NOT_COPIED = frozenset({COMMIT_RECORD_NAME, committing.CLAIM_NAME, committing.LEGACY_CLAIM_NAME})
# A rank's data files, plain or with the save's token (storage/writer.py: ``_prefix``).
_DATA_FILE = re.compile(r"__(\d+)_.*\.distcp")
MARKER_PREFIX = ".drained."
# How long rank 0 waits for the other ranks' markers after its own copy, without a retry deadline.
MARKER_WAIT_SECONDS = 600.0


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
    marker_wait: float = MARKER_WAIT_SECONDS,
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
                logger.info(
                    "not draining %s: %s already names the newer %s",
                    src,
                    pointer.pointer_url(durable),
                    layout.format_iteration(latest),
                )
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
    local: Location,
    durable: Location,
    job: DrainJob,
    rank: int,
    world_size: int,
    workers: int,
    per_node: bool,
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
    durable.backend.write_small_atomic(
        durable.join(layout.format_iteration(iteration), marker_name(rank)), job.token.encode()
    )
    logger.debug(
        "copied rank %d's files of %s to %s",
        rank,
        local.url_of(layout.iteration_path(local, iteration)),
        durable.url_of(layout.iteration_path(durable, iteration)),
    )
    return nbytes


def _require_committed_locally(
    local: Location, durable: Location, iteration: int, token: str | None = None
) -> CommitRecord:
    """The local commit record of ``iteration`` (per node, of the save ``token``: every rank's
    copy is one save).

    Raises:
        DrainError: the local copy is not committed (or is another save's); naming both folders.
    """
    record, why = run_listing.inspect_iteration(local, iteration)
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
    local: Location,
    durable: Location,
    job: DrainJob,
    world_size: int,
    keep_last_n: int | None,
    marker_wait: float,
    workers: int,
    per_node: bool,
) -> tuple[tuple[str, ...], int]:
    """Rank 0's part of :func:`drain_iteration`, after the pointer check."""
    iteration = job.iteration
    src = local.url_of(layout.iteration_path(local, iteration))
    dst = durable.url_of(layout.iteration_path(durable, iteration))
    record = _require_committed_locally(local, durable, iteration)
    durable_record, reason = run_listing.inspect_iteration(durable, iteration)
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
        logger.info(
            "overwriting %s, left by a drain that never finished (%s)",
            dst,
            "another save's commit" if durable_record is not None else reason,
        )
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
        nbytes = _copy_own(
            local,
            durable,
            iteration,
            0,
            world_size,
            lambda name: phase_of(name) == DATA,
            workers,
            assembled=assembled,
        )
        _wait_for_markers(durable, job, world_size, marker_wait)
        nbytes += _copy_own(
            local,
            durable,
            iteration,
            0,
            world_size,
            lambda name: phase_of(name) != DATA,
            workers,
            written=written,
        )
    logger.debug("copied %s to %s; committing it there", src, dst)
    # Per node, every rank saved alone: the durable copy is one save of world_size ranks, with rank 0's token.
    writers = world_size if per_node else record.world_size
    latest = committing.publish(
        durable, iteration, record.keys, writers, save_id=job.token if per_node else record.save_id
    )
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
    return self_contained_files(
        local, files, keep=bases.holds, prefix="__ref_" if rank is None else "__0_ref_"
    )


def _copy_own(
    local: Location,
    durable: Location,
    iteration: int,
    rank: int,
    world_size: int,
    which: Callable[[str], bool],
    workers: int,
    *,
    assembled: Mapping[str, list[Piece]] | None = None,
    written: Mapping[str, bytes] | None = None,
) -> int:
    """Copy the files of ``iteration`` that ``rank`` owns and ``which`` accepts (``written`` in
    place of the listed files of its names), and ``assembled``; return their bytes."""
    files = {
        name: size
        for name, size in list_files(local, layout.iteration_path(local, iteration)).items()
        if posixpath.basename(name) not in _NOT_COPIED
        and owner_of(name, world_size) == rank
        and which(name)
        and name not in (written or {})
    }
    check_inside(local, files)
    nbytes = sum(files.values()) + pieces_bytes(assembled or {}) + sum(map(len, (written or {}).values()))
    logger.debug(
        "rank %d copies %d files (%.1f MiB) of %s",
        rank,
        len(files),
        nbytes / 2**20,
        layout.format_iteration(iteration),
    )
    copy_files(local, durable, files, workers=workers, assembled=assembled, written=written)
    return nbytes


def _copy_rank_data(
    local: Location,
    durable: Location,
    iteration: int,
    rank: int,
    workers: int,
    assembled: Mapping[str, list[Piece]],
) -> int:
    """Per node: copy this rank's data files of ``iteration``, and ``assembled``, renamed as
    ``rank``'s; return their bytes."""
    files = {
        name: size
        for name, size in list_files(local, layout.iteration_path(local, iteration)).items()
        if posixpath.basename(name) not in _NOT_COPIED and phase_of(name) == DATA
    }
    check_inside(local, files)
    copy_files(
        local,
        durable,
        files,
        workers=workers,
        rename=lambda name: rank_file_name(name, rank),
        assembled=assembled,
    )
    return sum(files.values()) + pieces_bytes(assembled)


def _local_metadata(
    local: Location, iteration: int, key: str, written: Mapping[str, bytes]
) -> tuple[str, bytes]:
    """The path and bytes of a key's local ``.metadata``, or of its self-contained rewrite in ``written``."""
    path = posixpath.join(layout.key_path(local, iteration, key), METADATA_NAME)
    name = posixpath.join(layout.format_iteration(iteration), key, METADATA_NAME)
    return path, written[name] if name in written else local.backend.call("cat_file", path)


def _upload_metadata_parts(
    local: Location,
    durable: Location,
    iteration: int,
    rank: int,
    keys: tuple[str, ...],
    written: Mapping[str, bytes],
) -> None:
    """Per node, rank > 0: each key's local ``.metadata``, for rank 0 to merge (before the marker)."""
    for key in keys:
        _, data = _local_metadata(local, iteration, key, written)
        durable.backend.write_small_atomic(
            posixpath.join(layout.key_path(durable, iteration, key), metadata_part_name(rank)), data
        )


def _write_merged_metadata(
    local: Location,
    durable: Location,
    job: DrainJob,
    keys: tuple[str, ...],
    world_size: int,
    written: Mapping[str, bytes],
) -> int:
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
            raise DrainError(
                f"cannot merge the ranks' copies of key {key!r} into {durable.url_of(folder)}: {e}"
            ) from e
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
    paths = [
        durable.join(layout.format_iteration(iteration), marker_name(rank)) for rank in range(1, world_size)
    ]
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
