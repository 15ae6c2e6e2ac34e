"""``cp``: copy a checkpoint, an iteration folder or a whole run between any two URLs.

Files are copied in parallel, each streamed in ranged reads (bounded memory) into the storage
layer's own atomic uploads (each backend's ``new_upload``, :mod:`dcp_fsspec.storage.backends`). The order is the
commit protocol's: every data file first, then every ``.metadata``, then every ``.commit.json``,
and ``latest_checkpoint.txt`` last, so a copy that dies part-way leaves a destination that no
reader takes for a checkpoint. A run is copied as its committed iterations and its pointer;
folders of saves that never finished are left behind (and listed). Temporary files of writes in
progress are never copied.

Every listed name is checked before anything is written: a name that would land outside the
destination (a ``..`` component, an absolute path, a scheme, a backslash: an S3 key may hold any
of them) is refused, and so is a symbolic link in a local source that leads out of it. Both are
errors naming the file, not files skipped with a warning: a copy missing a data file that
``.metadata`` lists would still be committed at the destination, and damaged.
"""

from __future__ import annotations

import argparse
import logging
import os
import posixpath
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from ..checkpoint import commit, layout
from ..errors import CheckpointExistsError, CorruptCheckpointError, DcpFsspecError, StorageError
from ..storage.failures import storage_errors
from ..storage.fetch import fetch_in_order, plan_spans
from ..storage.names import COMMIT_RECORD_NAME, METADATA_NAME, POINTER_NAME, is_temporary, relative_path_problem
from ..storage.uploads import ByteBudget, FileUpload
from ..storage.urls import Location, resolve
from . import _cli, targets
from .progress import Progress, human_bytes

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
_METADATA = re.compile(r"(__\d+)?" + re.escape(METADATA_NAME))  # names.metadata_name(rank), any rank


@dataclass
class CopyResult:
    """What :func:`copy_checkpoint` copied."""

    src: str
    dst: str
    kind: str
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # uncommitted iteration folders left behind

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The result in words, for the terminal."""
        lines = [f"skipped {folder}: not committed" for folder in self.skipped]
        lines.append(
            f"copied {self.src} -> {self.dst}: {self.files} files, {human_bytes(self.bytes)} in {self.seconds:.1f} s"
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

    Raises:
        CheckpointNotFoundError: nothing at ``src`` to copy.
        CheckpointExistsError: ``dst`` is not empty and ``overwrite`` is False.
        CorruptCheckpointError: a file at ``src`` would be written outside ``dst`` (a name with
            ``..``, say), or is a symbolic link leading out of ``src``; nothing was written.
        StorageError: reading or writing failed; the destination is left uncommitted.
    """
    start = time.perf_counter()
    source = resolve(src, storage_options)
    dest = resolve(dst, dst_storage_options)
    target = targets.classify(source)
    result = CopyResult(source.url, dest.url, target.kind)
    files = _files_to_copy(source, target, result.skipped)
    _check_inside(source, files)
    _clear_destination(dest, files, overwrite)
    if progress is not None:
        progress.add_total(sum(files.values()))
    copier = _Copier(source, dest, chunk_bytes, progress)
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="dcp-fsspec-cp") as pool:
        for phase, names in enumerate(_phases(files)):
            copy: Callable[[str, int], None] = copier.copy_large if phase == 0 else copier.copy_small
            futures = [pool.submit(copy, name, files[name]) for name in names]
            errors = [f.exception() for f in futures]
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
    result.files, result.bytes = len(files), sum(files.values())
    result.seconds = time.perf_counter() - start
    logger.info(
        "copied %s (%d files, %s) to %s in %.1f s", source.url, result.files, human_bytes(result.bytes),
        dest.url, result.seconds,
    )  # fmt: skip
    return result


def _files_to_copy(source: Location, target: targets.Target, skipped: list[str]) -> dict[str, int]:
    """Relative path → size of every file to copy."""
    if target.kind != "run":
        if target.kind == "iteration":
            assert target.run is not None and target.iteration is not None
            _, why = commit.inspect_iteration(target.run, target.iteration)
            if why is not None:
                logger.warning("%s is not committed (%s); copying it as it is", source.url, why)
        return _find(source, source.path)
    files: dict[str, int] = {}
    committed = set(commit.committed_iterations(source))
    for iteration in layout.list_iterations(source):
        folder = layout.iteration_path(source, iteration)
        if iteration in committed:
            files.update(_find(source, folder))
        else:
            skipped.append(source.url_of(folder))
            logger.warning("not copying %s: not committed (a save that never finished)", source.url_of(folder))
    pointer = source.join(POINTER_NAME)
    if commit.exists(source, pointer):
        files[POINTER_NAME] = int(source.fs.info(pointer).get("size") or 0)
    return files


def _find(source: Location, folder: str) -> dict[str, int]:
    source.fs.invalidate_cache(folder)
    try:
        with storage_errors("list", source.url_of(folder)):
            found = source.fs.find(folder, detail=True)
    except FileNotFoundError:
        return {}
    prefix = source.path.rstrip("/") + "/"
    return {
        path[len(prefix) :]: int(info.get("size") or 0)
        for path, info in found.items()
        if path.startswith(prefix) and not is_temporary(path)
    }


def _check_inside(source: Location, files: dict[str, int]) -> None:
    """Refuse, before anything is written, a name that would leave the destination or a link out of the source."""
    for name in sorted(files):
        url = source.url_of(source.join(name))
        problem = relative_path_problem(name)
        if problem is not None:
            raise CorruptCheckpointError(
                f"refusing to copy {source.url}: it lists {url!r}, which would be written outside the "
                f"destination ({problem}); remove that file from the source"
            )
        real = source.backend.link_out_of(source.join(name), source.path)
        if real is not None:
            raise CorruptCheckpointError(
                f"refusing to copy {source.url}: {url} is a symbolic link to {real}, outside the folder "
                "being copied; replace the link with the file itself, or remove it"
            )


def _phase_of(name: str) -> int:
    base = posixpath.basename(name)
    if name == POINTER_NAME:
        return 3
    if base == COMMIT_RECORD_NAME:
        return 2
    if _METADATA.fullmatch(base):
        return 1
    return 0


def _phases(files: dict[str, int]) -> list[list[str]]:
    """Data files, then ``.metadata`` files, then commit records, then the pointer."""
    phases: list[list[str]] = [[], [], [], []]
    for name in sorted(files):
        phases[_phase_of(name)].append(name)
    return phases


def _clear_destination(dest: Location, files: dict[str, int], overwrite: bool) -> None:
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
    replaced = [name for name in files if _phase_of(name) > 0 and dest.join(name) in present]
    for name in sorted(replaced, key=_phase_of, reverse=True):  # pointer first, .metadata last
        try:
            with storage_errors("remove (before replacing it)", dest.url_of(dest.join(name))):
                dest.fs.rm_file(dest.join(name))
        except FileNotFoundError:
            pass
        dest.fs.invalidate_cache(posixpath.dirname(dest.join(name)))


class _Copier:
    def __init__(self, source: Location, dest: Location, chunk_bytes: int, progress: Progress | None) -> None:
        self.source = source
        self.dest = dest
        self.chunk_bytes = max(1, chunk_bytes)
        self.progress = progress
        self.budget = ByteBudget(256 * MiB)

    def _paths(self, name: str) -> tuple[str, str]:
        dst_path = self.dest.join(name)
        self.dest.backend.make_folder(posixpath.dirname(dst_path))
        return self.source.join(name), dst_path

    def _failed(self, name: str, error: BaseException) -> DcpFsspecError:
        return StorageError(
            f"cannot copy {self.source.url_of(self.source.join(name))} to "
            f"{self.dest.url_of(self.dest.join(name))}: {error}"
        )

    def copy_large(self, name: str, size: int) -> None:
        """A data file: ranged reads streamed into an atomic upload."""
        try:
            src_path, dst_path = self._paths(name)
            upload: FileUpload = self.dest.backend.new_upload(dst_path, part_size=16 * MiB, budget=self.budget)
        except OSError as e:
            raise self._failed(name, e) from e
        try:
            spans = plan_spans([(src_path, 0, size)], max_gap=0, max_span=self.chunk_bytes) if size else []
            for span, data in fetch_in_order(self.source.fs, spans, window_bytes=2 * self.chunk_bytes, threads=2):
                if len(data) != span.size:
                    raise StorageError(
                        f"{self.source.url_of(src_path)} changed while being copied: bytes [{span.start}, "
                        f"{span.end}) gave {len(data)} bytes"
                    )
                upload.write([memoryview(data)])
                if self.progress is not None:
                    self.progress.advance(len(data))
            upload.commit()
        except BaseException as e:
            upload.abort()
            if isinstance(e, OSError) and not isinstance(e, DcpFsspecError):
                raise self._failed(name, e) from e
            raise

    def copy_small(self, name: str, size: int) -> None:
        """A commit file (``.metadata``, ``.commit.json``, the pointer): one read, one atomic write."""
        try:
            src_path, dst_path = self._paths(name)
            data = self.source.fs.cat_file(src_path)
            self.dest.backend.write_small_atomic(dst_path, data)
        except OSError as e:
            raise self._failed(name, e) from e
        self.dest.fs.invalidate_cache(posixpath.dirname(dst_path))
        if self.progress is not None:
            self.progress.advance(len(data))


# --- the subcommand ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = ("src", "a DCP checkpoint, an iteration folder, or a save_dirname (a whole run)")
    destination = ("dst", "the URL the copy gets (it becomes the copy; it must be empty)")
    _cli.add_standard_arguments(parser, source, destination, destination=True)
    parser.add_argument("--overwrite", action="store_true", help="copy into a destination that is not empty")
    parser.add_argument("--workers", type=int, default=8, help="files copied at once (default: 8)")


def main(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise _cli.UsageError(f"--workers must be at least 1, got {args.workers}")
    source_options, dest_options = _cli.both_storage_options(args, args.src, args.dst)
    with Progress("copying") as progress:
        result = copy_checkpoint(
            args.src, args.dst, source_options, dest_options,
            overwrite=args.overwrite, workers=args.workers, progress=progress,
        )  # fmt: skip
    _cli.report(args, result.to_dict(), result.lines())
    return _cli.EXIT_OK
