"""``verify``: check a checkpoint, an iteration folder or a whole run on storage, without loading it.

Each DCP checkpoint is checked by :func:`dcp_fsspec.storage.checkpoint_files.integrity.verify_checkpoint`
(every file present and long enough, every record decoded, every CRC-32 compared; see there).
This module adds what knows runs: given an iteration folder, it verifies every key its commit
record lists (a listed key without ``.metadata`` is a problem); given a ``save_dirname``, every
committed iteration and the pointer (uncommitted and retired folders are noted, not failed). A key's
references into other iterations are followed and checked like its own files. Damage is
reported, not raised: each :class:`~dcp_fsspec.storage.checkpoint_files.integrity.VerifyProblem` names the
file, the item and, for a checksum mismatch, both CRC-32s. Errors are raised only when there is
nothing to verify (:class:`CheckpointNotFoundError`) or the backend fails (:class:`StorageError`).
"""

from __future__ import annotations

import argparse
import os
import posixpath
from collections.abc import Callable
from typing import Any

from dcp_fsspec.checkpoint.commit import layout, pointer, run_listing
from dcp_fsspec.checkpoint.commit.commit_record import referable
from dcp_fsspec.errors import CorruptCheckpointError
from dcp_fsspec.storage.checkpoint_files.integrity import VerifyProblem, VerifyReport, verify_checkpoint
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, METADATA_NAME
from dcp_fsspec.storage.transport.urls import Location, resolve
from dcp_fsspec.tools import _cli, targets
from dcp_fsspec.tools.progress import Progress, human_bytes

MiB = 1024 * 1024
# What verify says of an iteration retention retired (ls shows it as "retired").
RETIRED = (
    "retired by retention (it no longer loads; the files kept iterations refer to are verified with them)"
)


def verify(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    window_bytes: int = 64 * MiB,
    max_request_bytes: int = 16 * MiB,
    threads: int = 8,
    progress: Progress | None = None,
    trust_checkpoint: bool = False,
    references: bool = False,
) -> VerifyReport:
    """Check the checkpoint, iteration folder or save_dirname at ``url``; report what is wrong.

    Args:
        url: any fsspec URL or local path.
        storage_options: options for the fsspec filesystem.
        window_bytes: downloaded-but-not-yet-checked data held at once (bounds memory).
        max_request_bytes: the largest single ranged read.
        threads: concurrent reads on filesystems without an async API.
        progress: advanced by the bytes read, if given.
        trust_checkpoint: unpickle each ``.metadata`` in full, whatever classes it names (runs
            any code it holds); by default one naming a class DCP metadata does not consist of is
            a problem, and nothing it names runs.
        references: follow references to sibling checkpoints (``../step-10/…``, a plain
            layout's incremental saves); a Checkpointer's references between iterations are
            always followed.

    Returns:
        The report; ``report.ok`` is False when anything was found wrong.

    Raises:
        CheckpointNotFoundError: nothing at ``url`` is a checkpoint, iteration folder or
            save_dirname.
        StorageError: the backend failed while listing or reading.
        InvalidURLError, MissingDriverError: see :func:`dcp_fsspec.storage.transport.urls.resolve`.
    """
    target = targets.classify(resolve(url, storage_options))
    location = target.location
    report = VerifyReport(url=location.url, kind=target.kind)

    def one_checkpoint(key: Location) -> VerifyReport:
        return verify_checkpoint(
            key.url,
            fs=key.fs,
            window_bytes=window_bytes,
            max_request_bytes=max_request_bytes,
            threads=threads,
            retry=key.retry,
            progress=progress,
            trust_checkpoint=trust_checkpoint,
            references=references,
        )

    checker = _Checker(report, one_checkpoint)
    if target.kind == "checkpoint":
        checker.checkpoint(location)
    elif target.kind == "iteration":
        assert target.run is not None and target.iteration is not None
        checker.iteration(target.run, target.iteration, standalone=True)
    else:
        checker.run(location)
    return report


class _Checker:
    """Walks a run or an iteration folder, verifying each committed key's checkpoint."""

    def __init__(self, report: VerifyReport, one_checkpoint: Callable[[Location], VerifyReport]) -> None:
        self.report = report
        self.one_checkpoint = one_checkpoint

    def problem(self, url: str, item: str | None, what: str) -> None:
        self.report.problems.append(VerifyProblem(url, item, what))

    # --- a save_dirname and its iterations ------------------------------------------------------

    def run(self, root: Location) -> None:
        pointer_url = pointer.pointer_url(root)
        try:
            latest = pointer.read_pointer(root)
        except CorruptCheckpointError as e:
            self.problem(pointer_url, None, str(e))
            latest = None
        committed = []
        for iteration in layout.list_iterations(root):
            if self.iteration(root, iteration, standalone=False):
                committed.append(iteration)
        if latest is not None and latest not in committed:
            self.problem(
                pointer_url,
                None,
                f"names {layout.format_iteration(latest)}, which is not a committed iteration",
            )
        elif latest is None and committed and not self.report.problems:
            self.report.notes.append(f"{pointer_url} does not exist: a Checkpointer would start from scratch")

    def iteration(self, run: Location, iteration: int, *, standalone: bool) -> bool:
        """Verify one iteration folder; whether it is committed."""
        folder = run.url_of(layout.iteration_path(run, iteration))
        record_url = run.url_of(posixpath.join(layout.iteration_path(run, iteration), COMMIT_RECORD_NAME))
        try:
            record, keys = targets.iteration_keys(run, iteration)
        except CorruptCheckpointError as e:
            self.problem(record_url, None, str(e))
            return False
        if record is None and referable(run, iteration):
            # Retention let go of it, keeping the files kept iterations refer to: those are
            # verified with the iterations that refer to them.
            self.report.notes.append(f"skipped {folder}: {RETIRED}")
            return False
        if record is None:
            if not standalone:
                self.report.notes.append(f"skipped {folder}: not committed (a save that never finished)")
                return False
            self.problem(
                record_url, None, f"does not exist: {folder} is not committed (its save never finished)"
            )
        for key in keys:
            location = targets.key_location(run, iteration, key)
            if record is not None and not run_listing.key_is_committed(run, iteration, key):
                self.problem(
                    location.url_of(location.join(METADATA_NAME)),
                    None,
                    f"does not exist, but {COMMIT_RECORD_NAME} lists key {key!r}",
                )
                continue
            self.checkpoint(location)
        return record is not None

    def checkpoint(self, location: Location) -> None:
        self.report.add(self.one_checkpoint(location))


# --- the subcommand ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _cli.add_standard_arguments(
        parser,
        (
            "url",
            "a DCP checkpoint, an iteration folder (every key), or a save_dirname (every committed iteration)",
        ),
    )
    _cli.add_trust_flag(parser)
    _cli.add_references_flag(parser)


def main(args: argparse.Namespace) -> int:
    with Progress("verifying") as progress:
        report = verify(
            args.url,
            _cli.storage_options(args.storage_options),
            progress=progress,
            trust_checkpoint=args.trust,
            references=args.references,
        )
    # Counted as the user saved them: an iteration is one checkpoint, however many keys it holds.
    saved, keys = len({posixpath.dirname(url) for url in report.checkpoints}), len(report.checkpoints)
    counted = f"{keys} checkpoint" if report.kind == "checkpoint" else f"{saved} checkpoint(s) ({keys} keys)"
    summary = (
        f"{counted}, {report.items} items, {report.tensors_checked} tensors "
        f"checked against their CRC-32, {_without_checksum(report)}, {human_bytes(report.bytes_read)} read"
    )
    if report.referenced_bytes:
        summary += (
            f"; records: {human_bytes(report.own_bytes)} in the checkpoints' own files, "
            f"{human_bytes(report.referenced_bytes)} referenced in other checkpoints' (incremental saves)"
        )
    lines = [f"note: {note}" for note in report.notes] + [f"PROBLEM {problem}" for problem in report.problems]
    lines.append(f"{'OK' if report.ok else f'{len(report.problems)} PROBLEM(S) in'} {report.url}: {summary}")
    _cli.report(args, report.to_dict(), lines)
    return _cli.EXIT_OK if report.ok else _cli.EXIT_PROBLEM


def _without_checksum(report: VerifyReport) -> str:
    """How many items had no checksum to compare, and what they are."""
    tensors = report.unchecked - report.objects
    kinds = (
        [f"{report.objects} non-tensor entries: pickled values, which DCP stores without one"]
        if report.objects
        else []
    )
    if tensors:
        kinds.append(f"{tensors} tensors stored without one: empty, or saved with checksums=False")
    return f"{report.unchecked} without a checksum" + (f" ({'; '.join(kinds)})" if kinds else "")
