"""``ls``: the iterations under a Checkpointer's save_dirname, committed or not, and the latest.

One row per iteration folder: committed, retired (let go of by retention, but kept iterations
refer to some of its files), or why not committed (in the words of
:func:`dcp_fsspec.checkpoint.commit.run_listing.listed_inspection`); whether the pointer names it; its size
on storage; and its age (from the commit record's ``saved_at``). One recursive listing of the
save_dirname gives all of it but the commit records, which are read for the folders that show
one: the requests do not grow with the number of folders that are not checkpoints.

An incremental save's keys also read records in other iterations' files. With ``referenced``,
the bytes they refer to are shown apart from the folder's own. They come from each incremental
key's ``.metadata``, read all at once; unpickling it imports torch, which costs seconds, so a
plain ``ls`` leaves them out and says which iterations are incremental.
"""

from __future__ import annotations

import argparse
import logging
import os
import posixpath
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from dcp_fsspec.checkpoint.commit import layout, pointer, referenced
from dcp_fsspec.checkpoint.commit.at_once import at_once
from dcp_fsspec.checkpoint.commit.commit_record import referable
from dcp_fsspec.checkpoint.commit.run_listing import Listing, list_save_dirname, listed_inspection
from dcp_fsspec.checkpoint.tiers.replica_files import ReplicaFolder, replica_folders
from dcp_fsspec.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_fsspec.storage.format.names import POINTER_NAME
from dcp_fsspec.storage.transport.urls import Location, resolve
from dcp_fsspec.tools import _cli, targets
from dcp_fsspec.tools.progress import human_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IterationInfo:
    """One iteration folder under a save_dirname."""

    iteration: int
    name: str
    url: str
    committed: bool
    latest: bool
    size_bytes: int
    keys: list[str]
    saved_at: float | None  # seconds since the epoch, from the commit record
    why_uncommitted: str | None = None
    retired: bool = False  # let go of by retention; kept iterations refer to some of its files
    incremental: bool = False  # some key lists content hashes: it may refer to other iterations
    # The bytes of records in other iterations' files that its keys refer to (size_bytes counts
    # its own folder only); None unless asked for, or where a key's .metadata is unreadable.
    referenced_bytes: int | None = None


@dataclass
class RunListing:
    """Everything ``ls`` shows about a save_dirname."""

    url: str
    latest: int | None
    iterations: list[IterationInfo] = field(default_factory=list)
    pointer_problem: str | None = None
    referenced: bool = False  # the bytes each iteration refers to were read
    # In a rank's folder of a per-node local tier: the copies of other ranks' shares it holds.
    replicas: list[ReplicaFolder] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The listing in words: a table of iterations, then what is wrong with the pointer."""
        now = time.time()
        incremental = any(info.incremental for info in self.iterations)
        refers = self.referenced and incremental
        rows = [
            ("iteration", "latest", "committed", "size", *(("referenced",) if refers else ()), "age", "keys")
        ]
        for info in self.iterations:
            rows.append(
                (
                    info.name,
                    "*" if info.latest else "",
                    _state(info),
                    human_bytes(info.size_bytes),
                    *((_referenced(info.referenced_bytes),) if refers else ()),
                    _cli.age(None if info.saved_at is None else now - info.saved_at),
                    ",".join(info.keys),
                )
            )
        lines = [self.url, _cli.table(rows)]
        if refers:
            lines.append(
                "size: the iteration's own files; referenced: bytes it reads in older iterations' files"
            )
        elif incremental:
            lines.append(
                "size: the iteration's own files; incremental ones also read older iterations' files "
                "(--referenced shows how many bytes)"
            )
        if self.replicas:
            lines.append("replicas held here (copies of other ranks' local shares):")
            replica_rows = [("rank", "iteration", "committed", "size")]
            for replica in self.replicas:
                replica_rows.append(
                    (
                        str(replica.src),
                        layout.format_iteration(replica.iteration),
                        "yes" if replica.committed else "no: no manifest (its transfer did not finish)",
                        human_bytes(replica.size_bytes),
                    )
                )
            lines.append(_cli.table(replica_rows))
        if self.pointer_problem:
            lines.append(f"pointer: {self.pointer_problem}")
        elif self.latest is None:
            lines.append(f"no {POINTER_NAME}: a Checkpointer would start from scratch")
        elif not any(i.latest for i in self.iterations):
            lines.append(f"{POINTER_NAME} names {layout.format_iteration(self.latest)}, which has no folder")
        return lines


def _state(info: IterationInfo) -> str:
    if info.committed:
        return "yes"
    return "retired" if info.retired else f"no: {info.why_uncommitted}"


def _referenced(count: int | None) -> str:
    return "?" if count is None else human_bytes(count) if count else "-"


def list_run(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, referenced: bool = False
) -> RunListing:
    """Describe every iteration folder under the save_dirname ``url``.

    Args:
        referenced: also read how many bytes each incremental iteration refers to in others
            (each incremental key's ``.metadata``; imports torch).

    Raises:
        CheckpointNotFoundError: ``url`` is not a save_dirname (no pointer, no iteration folders).
        StorageError: the backend failed.
    """
    target = targets.classify(resolve(url, storage_options))
    root = target.location
    if target.kind != "run":
        raise CheckpointNotFoundError(_not_a_run(target))
    listing = RunListing(url=root.url, latest=None, referenced=referenced)
    try:
        listing.latest = pointer.read_pointer(root)
    except CorruptCheckpointError as e:
        listing.pointer_problem = str(e)
    # One listing gives every folder, its size, and which show a commit record: only the
    # records themselves are read, so junk folders cost nothing more.
    listed = list_save_dirname(root)
    outside = _referenced_bytes(root, listed) if referenced else None
    for iteration in listed.folders:
        counted = None if outside is None else outside.get(iteration, 0)
        listing.iterations.append(_describe(root, listed, iteration, listing.latest, counted))
    if layout.parse_rank_folder(posixpath.basename(root.path.rstrip("/"))) is not None:
        listing.replicas = replica_folders(root)  # a rank's folder of a per-node local tier
    return listing


def _referenced_bytes(root: Location, listed: Listing) -> dict[int, int | None]:
    """Each iteration with incremental keys → the bytes they refer to in other iterations'
    files; ``None`` where a ``.metadata`` is damaged or gone (``verify`` says what is wrong)."""
    keys = [
        (i, key) for i in listed.folders for key in listed.incremental_keys(i) if (i, key) in listed.finished
    ]

    def count(iteration: int, key: str) -> int | None:
        try:
            return sum(referenced.key_references(root, iteration, key).values())
        except (CheckpointNotFoundError, CorruptCheckpointError) as e:
            logger.warning("%s", e)
            return None

    counts = at_once([partial(count, i, key) for i, key in keys], one_by_one=root.answers_locally)
    found: dict[int, int | None] = {}
    for (iteration, _), n in zip(keys, counts, strict=True):
        before = found.get(iteration, 0)
        found[iteration] = None if before is None or n is None else before + n
    return found


def _not_a_run(target: targets.Target) -> str:
    """Why ``ls`` cannot list ``target``, and the commands that can."""
    url = target.location.url
    what = "a DCP checkpoint" if target.kind == "checkpoint" else "an iteration folder"
    advice = f"`dcp-fsspec inspect {url}` shows what it holds"
    run = target.run or _run_of_key(target.location)
    if run is not None:
        advice += f"; `dcp-fsspec ls {run.url}` lists its run's iterations"
    return f"{url} is {what}, not a save_dirname: {advice}"


def _run_of_key(checkpoint: Location) -> Location | None:
    """The save_dirname of a checkpoint that is a key of an iteration folder, else None."""
    folder = targets.parent_of(checkpoint)
    return targets.parent_of(folder) if layout.parse_iteration(folder.path) is not None else None


def _describe(
    root: Location, listed: Listing, iteration: int, latest: int | None, referenced_bytes: int | None
) -> IterationInfo:
    folder = layout.iteration_path(root, iteration)
    retired = False
    try:
        record, why = listed_inspection(root, listed, iteration, latest=latest)
        # Not committed, yet a record file is there: a retired mark, or a take-over mark.
        retired = record is None and iteration in listed.records and referable(root, iteration)
    except CorruptCheckpointError as e:
        record, why = None, str(e)
    if retired:
        why = "retired by retention: it no longer loads, and kept iterations refer to some of its files"
    return IterationInfo(
        iteration=iteration,
        name=layout.format_iteration(iteration),
        url=root.url_of(folder),
        committed=record is not None,
        latest=iteration == latest,
        size_bytes=listed.size(iteration),
        keys=list(record.keys) if record else [],
        saved_at=record.saved_at if record else None,
        why_uncommitted=why,
        retired=retired,
        incremental=bool(listed.incremental_keys(iteration)),
        referenced_bytes=referenced_bytes,
    )


# --- the subcommand ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _cli.add_standard_arguments(
        parser, ("url", "a Checkpointer's save_dirname (any fsspec URL or local path)")
    )
    parser.add_argument(
        "--referenced",
        action="store_true",
        help="also show the bytes each incremental iteration reads in older iterations' files (reads each key's .metadata)",
    )


def main(args: argparse.Namespace) -> int:
    listing = list_run(args.url, _cli.storage_options(args.storage_options), referenced=args.referenced)
    _cli.report(args, listing.to_dict(), listing.lines())
    return _cli.EXIT_OK
