"""``cp``: copy a checkpoint, an iteration folder or a whole run between any two URLs.

Files are copied by :mod:`dcp_fsspec.storage.checkpoint_files.copying`: in parallel, each streamed in ranged reads
(bounded memory) into the storage layer's own atomic uploads. The order is the commit protocol's:
every data file first, then every ``.metadata``, then every ``.commit.json``, and
``latest_checkpoint.txt`` last, so a copy that dies part-way leaves a destination that no
reader takes for a checkpoint. A run is copied as its committed iterations and its pointer;
folders of saves that never finished are left behind (and listed). Temporary files of writes in
progress are never copied.

Every listed name is checked before anything is written: a name that would land outside the
destination (a ``..`` component, an absolute path, a scheme, a backslash: an S3 key may hold any
of them) is refused, and so is a symbolic link in a local source that leads out of it. Both are
errors naming the file, not files skipped with a warning: a copy missing a data file that
``.metadata`` lists would still be committed at the destination, and damaged.

The copy stands alone. A checkpoint of an incremental save refers to records of another
checkpoint; its copy gets those records in data files of its own, and a rewritten ``.metadata``
(:mod:`dcp_fsspec.storage.checkpoint_files.self_contained`). A whole run's copy keeps a reference to an
iteration it copies too, and copies the records of any other (a retired iteration's).
"""

from __future__ import annotations

import argparse
import builtins
import logging
import os
import posixpath
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_fsspec.checkpoint.commit import layout, run_listing
from dcp_fsspec.errors import CheckpointExistsError
from dcp_fsspec.storage.checkpoint_files.copying import (
    DATA,
    Piece,
    check_inside,
    copy_files,
    list_files,
    phase_of,
    pieces_bytes,
)
from dcp_fsspec.storage.format.names import CONTENT_HASHES_NAME, POINTER_NAME
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.urls import Location, resolve
from dcp_fsspec.tools import _cli, targets
from dcp_fsspec.tools.progress import Progress, human_bytes

logger = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass
class CopyResult:
    """What :func:`copy_checkpoint` copied."""

    src: str
    dst: str
    kind: str
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    referenced_bytes: int = 0  # of ``bytes``, those of records copied from referenced checkpoints
    skipped: list[str] = field(default_factory=list)  # uncommitted iteration folders left behind

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def count(
        self, files: dict[str, int], assembled: dict[str, list[Piece]], written: dict[str, builtins.bytes]
    ) -> None:
        """Count what the copy writes: ``files`` as they are, the ``assembled`` data files, the
        ``written`` ``.metadata``."""
        self.referenced_bytes = pieces_bytes(assembled)
        self.files = len(files) + len(assembled) + len(written)
        self.bytes = sum(files.values()) + self.referenced_bytes + sum(map(len, written.values()))

    def done(self, start: float) -> None:
        """The copy that began at ``start`` (``time.perf_counter``) is done: time it and log it."""
        self.seconds = time.perf_counter() - start
        logger.info(
            "copied %s (%d files, %s) to %s in %.1f s",
            self.src,
            self.files,
            human_bytes(self.bytes),
            self.dst,
            self.seconds,
        )

    def lines(self) -> list[str]:
        """The result in words, for the terminal."""
        lines = [f"skipped {folder}: not committed" for folder in self.skipped]
        referenced = (
            f" ({human_bytes(self.referenced_bytes)} of it records of referenced checkpoints, copied in: "
            "the copy stands alone)"
            if self.referenced_bytes
            else ""
        )
        lines.append(
            f"copied {self.src} -> {self.dst}: {self.files} files, {human_bytes(self.bytes)}{referenced} "
            f"in {self.seconds:.1f} s"
        )
        return lines


def copy_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    *,
    overwrite: bool = False,
    workers: int = 8,
    chunk_bytes: int = 8 * MiB,
    progress: Progress | None = None,
    references: bool = False,
    trust_checkpoint: bool = False,
) -> CopyResult:
    """Copy the checkpoint, iteration folder or save_dirname at ``src`` to ``dst``.

    Args:
        src: what to copy (any fsspec URL or local path).
        dst: where it goes; it becomes the copy (``cp src dst``, not ``dst/basename(src)``).
        storage_options: fsspec options for ``src``.
        dst_storage_options: fsspec options for ``dst``.
        overwrite: copy into a destination that is not empty. Its commit files that the copy
            replaces (pointer, ``.commit.json``, ``.metadata``) are deleted first, so until the
            copy finishes the destination is uncommitted rather than mixed.
        workers: files copied at once.
        chunk_bytes: the size of each ranged read (each worker holds at most two).
        progress: advanced by the bytes copied, if given.
        references: follow references to sibling checkpoints (``../step-10/…``, a plain
            layout's incremental saves); references between iterations are always followed.
        trust_checkpoint: unpickle each ``.metadata`` in full, whatever classes it names.

    Raises:
        CheckpointNotFoundError: nothing at ``src`` to copy.
        CheckpointExistsError: ``dst`` is not empty and ``overwrite`` is False.
        CorruptCheckpointError: a file at ``src`` would be written outside ``dst`` (a name with
            ``..``, say), or is a symbolic link leading out of ``src``; a ``.metadata`` cannot be
            read, or refers to a file that is missing (or to a sibling checkpoint, without
            ``references``); nothing was written.
        StorageError: reading or writing failed; the destination is left uncommitted.
    """
    start = time.perf_counter()
    dest = resolve(dst, dst_storage_options)
    target = targets.classify(resolve(src, storage_options))
    source = target.location
    result = CopyResult(source.url, dest.url, target.kind)
    files, copied = _files_to_copy(source, target, result.skipped)
    check_inside(source, files)
    assembled, written = _self_contained(
        source, files, copied, references=references, trust_checkpoint=trust_checkpoint
    )
    for name in written:
        del files[name]
    _clear_destination(dest, [*files, *written], overwrite)
    result.count(files, assembled, written)
    if progress is not None:
        progress.add_total(result.bytes)
    copy_files(
        source,
        dest,
        files,
        workers=workers,
        chunk_bytes=chunk_bytes,
        on_bytes=None if progress is None else progress.advance,
        assembled=assembled,
        written=written,
    )
    result.done(start)
    return result


def _self_contained(
    source: Location, files: dict[str, int], copied: set[str], *, references: bool, trust_checkpoint: bool
) -> tuple[dict[str, list[Piece]], dict[str, bytes]]:
    """What makes each copied checkpoint stand alone (see :func:`~dcp_fsspec.storage.checkpoint_files.self_contained.self_contained_files`).

    Only an incremental save refers to others, and it leaves content hashes beside its
    ``.metadata``: a copy without any reads no ``.metadata`` and never imports torch.
    """
    if not any(posixpath.basename(name) == CONTENT_HASHES_NAME for name in files):
        return {}, {}
    from dcp_fsspec.storage.checkpoint_files.self_contained import (
        self_contained_files,
    )  # torch: only for incremental saves

    return self_contained_files(
        source,
        files,
        keep=lambda path: _iteration_folder(path) in copied,
        references=references,
        trust_checkpoint=trust_checkpoint,
    )


def _files_to_copy(
    source: Location, target: targets.Target, skipped: list[str]
) -> tuple[dict[str, int], set[str]]:
    """Relative path → size of every file to copy, and the iteration folders (paths) copied whole."""
    if target.kind != "run":
        if target.kind == "iteration":
            assert target.run is not None and target.iteration is not None
            _, why = run_listing.inspect_iteration(target.run, target.iteration)
            if why is not None:
                logger.warning("%s is not committed (%s); copying it as it is", source.url, why)
        return list_files(source, source.path), set()
    files: dict[str, int] = {}
    copied: set[str] = set()
    committed = set(run_listing.committed_iterations(source))
    for iteration in layout.list_iterations(source):
        folder = layout.iteration_path(source, iteration)
        if iteration in committed:
            files.update(list_files(source, folder))
            copied.add(folder)
        else:
            skipped.append(source.url_of(folder))
            logger.warning(
                "not copying %s: not committed (a save that never finished)", source.url_of(folder)
            )
    pointer = source.join(POINTER_NAME)
    if run_listing.exists(source, pointer):
        files[POINTER_NAME] = int(source.fs.info(pointer).get("size") or 0)
    return files, copied


def _iteration_folder(path: str) -> str:
    """The iteration folder holding a file of one of its keys (``…/iter_N/key/file``)."""
    return posixpath.dirname(posixpath.dirname(path))


def _clear_destination(dest: Location, files: Iterable[str], overwrite: bool) -> None:
    """Refuse a non-empty destination, or (``overwrite``) un-commit what the copy replaces."""
    dest.fs.invalidate_cache(dest.path)
    try:
        with storage_errors("list", dest.url):
            present = set(dest.fs.find(dest.path, withdirs=False))
            is_file = not present and dest.fs.isfile(dest.path)
    except FileNotFoundError:
        return
    if is_file:
        raise CheckpointExistsError(f"{dest.url} is a file; copy to a folder URL")
    if not present:
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{dest.url} is not empty; choose an empty destination, or pass --overwrite (overwrite=True) "
            "to copy into it, replacing files of the same names"
        )
    replaced = [name for name in files if phase_of(name) > DATA and dest.join(name) in present]
    for name in sorted(replaced, key=phase_of, reverse=True):  # pointer first, .metadata last
        try:
            with storage_errors("remove (before replacing it)", dest.url_of(dest.join(name))):
                dest.fs.rm_file(dest.join(name))
        except FileNotFoundError:
            pass
        dest.fs.invalidate_cache(posixpath.dirname(dest.join(name)))


# --- the subcommand ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = ("src", "a DCP checkpoint, an iteration folder, or a save_dirname (a whole run)")
    destination = ("dst", "the URL the copy gets (it becomes the copy; it must be empty)")
    _cli.add_standard_arguments(parser, source, destination, destination=True)
    parser.add_argument("--overwrite", action="store_true", help="copy into a destination that is not empty")
    parser.add_argument("--workers", type=int, default=8, help="files copied at once (default: 8)")
    _cli.add_references_flag(parser)
    _cli.add_trust_flag(parser)


def main(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise _cli.UsageError(f"--workers must be at least 1, got {args.workers}")
    source_options, dest_options = _cli.both_storage_options(args, args.src, args.dst)
    with Progress("copying") as progress:
        result = copy_checkpoint(
            args.src,
            args.dst,
            source_options,
            dest_options,
            overwrite=args.overwrite,
            workers=args.workers,
            progress=progress,
            references=args.references,
            trust_checkpoint=args.trust,
        )
    _cli.report(args, result.to_dict(), result.lines())
    return _cli.EXIT_OK
