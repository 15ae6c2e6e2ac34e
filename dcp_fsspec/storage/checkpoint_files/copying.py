"""Copying checkpoint files between two locations, in the order the commit protocol needs.

Shared by ``dcp-fsspec cp`` (:mod:`dcp_fsspec.tools.transfer`) and the two-tier checkpointer's
drain (:mod:`dcp_fsspec.checkpoint.tiers.drain`). Files are copied in parallel, each data file streamed
in ranged reads (bounded memory, no second copy of the file in memory) into the destination
backend's own atomic upload (``new_upload``: complete or absent), and each commit file (``.metadata``,
``.commit.json``, the pointer) in one atomic small write. Phases run one after the other: every
data file, then every ``.metadata``, then every commit record, then the pointer, so a copy that
dies part-way leaves a destination no reader takes for a checkpoint.

Names are listed from the source and checked before anything is written: a name that would land
outside the destination, or a symbolic link leading out of a local source, is refused.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from dcp_fsspec.errors import CorruptCheckpointError, DcpFsspecError, StorageError
from dcp_fsspec.storage.backends.uploads import ByteBudget, FileUpload
from dcp_fsspec.storage.format.names import (
    COMMIT_RECORD_NAME,
    METADATA_NAME,
    POINTER_NAME,
    is_temporary,
    relative_path_problem,
)
from dcp_fsspec.storage.read.fetch import fetch_in_order, plan_spans
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.urls import Location

MiB = 1024 * 1024
_METADATA = re.compile(r"(__\d+)?" + re.escape(METADATA_NAME))  # names.metadata_name(rank), any rank

# The copy phases, in order.
DATA, METADATA, RECORD, POINTER = range(4)

# Bytes [start, end) of a file (a path on the source's filesystem): a piece of a data file a
# copy assembles from ranges of others (a self-contained copy's, :mod:`~dcp_fsspec.storage.checkpoint_files.self_contained`).
Piece = tuple[str, int, int]


def pieces_bytes(files: Mapping[str, Iterable[Piece]]) -> int:
    """The bytes the data files made of pieces hold."""
    return sum(end - start for pieces in files.values() for _, start, end in pieces)


def list_files(source: Location, folder: str) -> dict[str, int]:
    """Every file under ``folder`` (a path on ``source``), relative to ``source``'s root → size.

    Temporary files of writes in progress are left out; a missing folder lists nothing.

    Raises:
        StorageError: the backend failed.
    """
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


def check_inside(source: Location, files: dict[str, int]) -> None:
    """Refuse a name that would leave the destination, or a link out of the source.

    Raises:
        CorruptCheckpointError: naming the file; nothing has been written.
    """
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


def phase_of(name: str) -> int:
    """Which phase copies ``name``: :data:`DATA`, :data:`METADATA`, :data:`RECORD` or :data:`POINTER`."""
    base = posixpath.basename(name)
    if name == POINTER_NAME:
        return POINTER
    if base == COMMIT_RECORD_NAME:
        return RECORD
    if _METADATA.fullmatch(base):
        return METADATA
    return DATA


def copy_files(
    source: Location,
    dest: Location,
    files: dict[str, int],
    *,
    workers: int = 8,
    chunk_bytes: int = 8 * MiB,
    on_bytes: Callable[[int], None] | None = None,
    rename: Callable[[str], str] | None = None,
    assembled: Mapping[str, Sequence[Piece]] | None = None,
    written: Mapping[str, bytes] | None = None,
) -> None:
    """Copy ``files`` (relative name → size, as :func:`list_files` gives) from ``source`` to ``dest``.

    Args:
        source: where the names are read (relative to its root).
        dest: where they are written, under the same relative names (or ``rename``'s).
        files: the files to copy.
        workers: files copied at once.
        chunk_bytes: the size of each ranged read (each worker holds at most two).
        on_bytes: called with each number of bytes copied (progress).
        rename: the relative name in ``dest`` of each name in ``source`` (the caller keeps it
            inside ``dest``).
        assembled: data files to write from pieces of files of ``source`` (a self-contained
            copy's, :mod:`~dcp_fsspec.storage.checkpoint_files.self_contained`), by relative name, copied with the data files.
        written: files to write with the bytes given (a rewritten ``.metadata``), by relative
            name, each in its phase.

    Raises:
        StorageError: reading or writing failed; the first error of the phase that failed. What
            was written stays (each file complete or absent), and later phases did not run.
    """
    copier = _Copier(source, dest, chunk_bytes, on_bytes, rename)
    phases: list[list[Callable[[], None]]] = [[], [], [], []]
    for name in sorted(files):
        copy = copier.copy_large if phase_of(name) == DATA else copier.copy_small
        phases[phase_of(name)].append(partial(copy, name, files[name]))
    for name, pieces in sorted((assembled or {}).items()):
        phases[DATA].append(partial(copier.assemble, name, pieces))
    for name, data in sorted((written or {}).items()):
        phases[phase_of(name)].append(partial(copier.write, name, data))
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="dcp-fsspec-copy") as pool:
        for jobs in phases:
            futures = [pool.submit(job) for job in jobs]
            errors = [f.exception() for f in futures]
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first


class _Copier:
    def __init__(
        self,
        source: Location,
        dest: Location,
        chunk_bytes: int,
        on_bytes: Callable[[int], None] | None,
        rename: Callable[[str], str] | None = None,
    ) -> None:
        self.source = source
        self.rename = rename
        self.dest = dest
        self.chunk_bytes = max(1, chunk_bytes)
        self.on_bytes = on_bytes
        self.budget = ByteBudget(256 * MiB)

    def _dest_name(self, name: str) -> str:
        return name if self.rename is None else self.rename(name)

    def _paths(self, name: str) -> tuple[str, str]:
        dst_path = self.dest.join(self._dest_name(name))
        self.dest.backend.make_folder(posixpath.dirname(dst_path))
        return self.source.join(name), dst_path

    def _failed(self, name: str, error: BaseException) -> DcpFsspecError:
        return StorageError(
            f"cannot copy {self.source.url_of(self.source.join(name))} to "
            f"{self.dest.url_of(self.dest.join(self._dest_name(name)))}: {error}"
        )

    def copy_large(self, name: str, size: int) -> None:
        """A data file: ranged reads streamed into an atomic upload."""
        self.assemble(name, [(self.source.join(name), 0, size)])

    def assemble(self, name: str, pieces: Sequence[Piece]) -> None:
        """A data file made of ``pieces`` (in order, each a range of a file of the source):
        ranged reads streamed into an atomic upload."""
        try:
            _, dst_path = self._paths(name)
            upload: FileUpload = self.dest.backend.new_upload(
                dst_path, part_size=16 * MiB, budget=self.budget
            )
        except OSError as e:
            raise self._failed(name, e) from e
        try:
            # Pieces in order and apart: each span is within one piece, so the spans come in order.
            spans = [
                span
                for path, start, end in pieces
                if end > start
                for span in plan_spans([(path, start, end)], max_gap=0, max_span=self.chunk_bytes)
            ]
            for span, data in fetch_in_order(
                self.source.fs, spans, window_bytes=2 * self.chunk_bytes, threads=2
            ):
                if len(data) != span.size:
                    raise StorageError(
                        f"{self.source.url_of(span.path)} changed while being copied: bytes [{span.start}, "
                        f"{span.end}) gave {len(data)} bytes"
                    )
                upload.write([memoryview(data)])
                if self.on_bytes is not None:
                    self.on_bytes(len(data))
            upload.commit()
        except BaseException as e:
            upload.abort()
            if isinstance(e, OSError) and not isinstance(e, DcpFsspecError):
                raise self._failed(name, e) from e
            raise

    def copy_small(self, name: str, size: int) -> None:
        """A commit file (``.metadata``, ``.commit.json``, the pointer): one read, one atomic write."""
        try:
            data = self.source.fs.cat_file(self.source.join(name))
        except OSError as e:
            raise self._failed(name, e) from e
        self.write(name, data)

    def write(self, name: str, data: bytes) -> None:
        """A small file with the bytes given: one atomic write."""
        try:
            _, dst_path = self._paths(name)
            self.dest.backend.write_small_atomic(dst_path, data)
        except OSError as e:
            raise self._failed(name, e) from e
        self.dest.fs.invalidate_cache(posixpath.dirname(dst_path))
        if self.on_bytes is not None:
            self.on_bytes(len(data))
