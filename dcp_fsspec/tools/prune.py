"""``prune``: retention by hand — keep the newest N committed iterations of a run, delete the rest.

The plan is :func:`dcp_fsspec.checkpoint.commit.retention.plan_deletions`, the one the Checkpointer
applies after each save, so the rules are the same: nothing is deleted without a pointer, the
iteration the pointer names is never deleted, nor anything newer than it (a save may be writing
it), nor any file a kept iteration of an incremental run refers to: such an iteration is
retired (see :mod:`dcp_fsspec.checkpoint.commit.retention`). Unlike the Checkpointer's own retention,
a failed delete is reported (exit code 4), not only logged.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_fsspec.checkpoint.commit import layout, pointer, retention
from dcp_fsspec.errors import CheckpointNotFoundError, StorageError, UsageError
from dcp_fsspec.storage.format.names import POINTER_NAME
from dcp_fsspec.storage.transport.urls import resolve
from dcp_fsspec.tools import _cli, targets

logger = logging.getLogger(__name__)


@dataclass
class PruneResult:
    """What :func:`prune` deleted and retired (or, with ``dry_run``, would)."""

    url: str
    keep: int
    latest: int | None
    dry_run: bool
    deleted: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    # Let go of, but kept iterations refer to some of their files: those stay, the others went.
    retired: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """As JSON; a dry run's plan is ``would_delete`` and ``would_retire``, and its
        ``deleted`` and ``retired`` are empty (true)."""
        doc = asdict(self)
        if self.dry_run:
            doc["would_delete"], doc["deleted"] = doc["deleted"], []
            doc["would_retire"], doc["retired"] = doc["retired"], []
        return doc


def prune(
    url: str | os.PathLike[str],
    keep: int,
    storage_options: dict[str, Any] | None = None,
    *,
    dry_run: bool = False,
) -> PruneResult:
    """Delete the iterations of the save_dirname ``url`` that ``keep_last_n=keep`` would delete.

    Returns:
        What was deleted, retired, kept, and what failed (a failed folder stays uncommitted or
        retired; running prune again retries it).

    Raises:
        ValueError: ``keep`` is below 1.
        CheckpointNotFoundError: ``url`` is not a save_dirname.
        CorruptCheckpointError: the pointer cannot be read (nothing is deleted then).
        StorageError: listing failed.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    target = targets.classify(resolve(url, storage_options))
    root = target.location  # the pointer's URL names its save_dirname
    if target.kind != "run":
        raise CheckpointNotFoundError(
            f"{root.url} is not a save_dirname (a folder of iter_* folders); nothing to prune"
        )
    latest = pointer.read_pointer(root)
    # The Checkpointer's own retention plan: one listing, whatever the number of folders.
    plan = retention.plan_from_storage(root, keep, latest=latest)
    result = PruneResult(
        root.url, keep, latest, dry_run, kept=[i for i in plan.iterations if i not in plan.delete]
    )
    if not dry_run:
        # In bulk (S3: 1,000 keys a request); a link among the folders is removed, never followed.
        result.failed = {i: str(e) for i, e in retention.let_go(root, plan).items()}
    result.deleted = [i for i in plan.whole if i not in result.failed]
    result.retired = [i for i in plan.retire if i not in result.failed]
    if not dry_run:
        for iteration in result.deleted:
            logger.info("deleted %s", root.url_of(layout.iteration_path(root, iteration)))
    return result


# --- the subcommand ------------------------------------------------------------------------------


# What ``prune --help`` shows first, before the exit codes: --keep has no default, on purpose.
FIRST_CALL = """a first call deletes nothing and shows what keeping the newest 3 would delete:
  dcp-fsspec prune s3://bucket/run1/checkpoints --keep 3 --dry-run
then the same without --dry-run deletes it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _cli.add_standard_arguments(parser, ("url", "a Checkpointer's save_dirname"))
    parser.add_argument(
        "--keep",
        type=int,
        required=True,
        metavar="N",
        help="committed iterations to keep (>= 1); required, with no default: see the first call below",
    )
    parser.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    parser.epilog = FIRST_CALL + ("\n\n" + parser.epilog if parser.epilog else "")


def main(args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise UsageError(f"--keep must be at least 1, got {args.keep}")
    result = prune(args.url, args.keep, _cli.storage_options(args.storage_options), dry_run=args.dry_run)
    if getattr(args, "json", False):
        _cli.print_json(result.to_dict())
    else:
        verb = "would delete" if result.dry_run else "deleted"
        if result.latest is None:
            print(f"{result.url}: no {POINTER_NAME}, so nothing is deleted")
        for iteration in result.deleted:
            print(f"{verb} {layout.format_iteration(iteration)}")
        for iteration in result.retired:
            print(
                f"{'would retire' if result.dry_run else 'retired'} {layout.format_iteration(iteration)}: "
                "kept iterations refer to some of its files, which stay"
            )
        for iteration, error in result.failed.items():
            print(f"FAILED to delete {layout.format_iteration(iteration)}: {error}")
        kept = ", ".join(layout.format_iteration(i) for i in result.kept) or "nothing"
        if result.dry_run:
            print(f"{result.url}: would keep {kept}; dry run, nothing was deleted")
        else:
            print(f"{result.url}: kept {kept}")
    if result.failed:
        raise StorageError(
            f"{len(result.failed)} iteration(s) of {result.url} could not be deleted or retired (each is left committed "
            "and whole, or no longer committed); "
            "run prune again to retry"
        )
    return _cli.EXIT_OK
