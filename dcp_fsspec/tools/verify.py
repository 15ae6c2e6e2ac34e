"""``verify``: check a whole checkpoint on storage without loading it into a model.

What is checked, per DCP checkpoint: ``.metadata`` unpickles; every tensor chunk it lists has a
storage entry; every data file an entry names exists and is long enough for every item in it;
every tensor record parses as torch's per-tensor archive, holds the dtype and shape
``.metadata`` promises, and its bytes match the CRC-32 stored in the record (CRC 0 means "not
recorded" and is counted, not failed). Pickled (non-tensor) entries are checked for presence
and size only: nothing in the format records a checksum for them.

It streams: the tensor records are read in file order as coalesced ranges
(:func:`~dcp_fsspec.storage.fetch.plan_spans`) through
:func:`~dcp_fsspec.storage.fetch.fetch_in_order`, so memory stays within ``window_bytes``
whatever the checkpoint's size; only a record too odd for our parser (and at most 64 MiB) is
held whole, to try ``torch.load`` on it.

Given an iteration folder, it verifies every key its commit record lists; given a
``save_dirname``, every committed iteration and the pointer. Damage is reported, not raised:
each :class:`VerifyProblem` names the file, the item and, for a checksum mismatch, both CRC-32s.
Errors are raised only when there is nothing to verify (:class:`CheckpointNotFoundError`) or
the backend fails (:class:`StorageError`).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import pickle
import posixpath
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..checkpoint import commit, layout
from ..errors import CorruptCheckpointError, DcpFsspecError, StorageError
from ..storage.fetch import fetch_in_order, plan_spans
from ..storage.records import (
    RecordFormatError,
    RecordLayout,
    descriptor_crc,
    parse_layout,
)
from ..storage.urls import Location, resolve
from . import _cli, targets
from .progress import Progress, human_bytes

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
_CRC_TAIL = 8  # a data descriptor's signature and CRC-32
_MAX_HEADER = MiB  # a record's zip header and data.pkl are a few hundred bytes
_MAX_WHOLE = 64 * MiB  # an unusual record up to this size is held whole and given to torch.load


@dataclass(frozen=True)
class VerifyProblem:
    """One thing wrong with a checkpoint.

    Attributes:
        url: the file concerned (a data file, ``.metadata``, ``.commit.json``, the pointer).
        item: the state-dict entry (fqn) concerned, if any.
        what: what is wrong, in words.
        stored_crc32: for a checksum mismatch, the CRC-32 stored in the record.
        actual_crc32: for a checksum mismatch, the CRC-32 of the bytes read.
    """

    url: str
    item: str | None
    what: str
    stored_crc32: int | None = None
    actual_crc32: int | None = None

    def __str__(self) -> str:
        text = f"{self.url}: {self.item + ': ' if self.item else ''}{self.what}"
        if self.stored_crc32 is not None and self.actual_crc32 is not None:
            text += f" (stored CRC-32 {self.stored_crc32:#010x}, read {self.actual_crc32:#010x})"
        return text


@dataclass
class VerifyReport:
    """What :func:`verify` checked and found.

    Attributes:
        url: the URL verified.
        kind: ``"checkpoint"``, ``"iteration"`` or ``"run"`` (a save_dirname).
        checkpoints: the URL of every DCP checkpoint verified.
        items: entries listed in their ``.metadata`` files.
        tensors_checked: tensor records whose CRC-32 was compared.
        unchecked: records present but without a checksum to compare (pickled objects,
            tensors saved without one, transformed records).
        bytes_read: bytes downloaded.
        problems: everything found wrong; empty when the checkpoint is sound.
        notes: things worth knowing that are not damage (e.g. uncommitted folders skipped).
    """

    url: str
    kind: str
    checkpoints: list[str] = field(default_factory=list)
    items: int = 0
    tensors_checked: int = 0
    unchecked: int = 0
    bytes_read: int = 0
    problems: list[VerifyProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def verify(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    window_bytes: int = 64 * MiB,
    max_request_bytes: int = 16 * MiB,
    threads: int = 8,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check the checkpoint, iteration folder or save_dirname at ``url``; report what is wrong.

    Args:
        url: any fsspec URL or local path.
        storage_options: options for the fsspec filesystem.
        window_bytes: downloaded-but-not-yet-checked data held at once (bounds memory).
        max_request_bytes: the largest single ranged read.
        threads: concurrent reads on filesystems without an async API.
        progress: advanced by the bytes read, if given.

    Returns:
        The report; ``report.ok`` is False when anything was found wrong.

    Raises:
        CheckpointNotFoundError: nothing at ``url`` is a checkpoint, iteration folder or
            save_dirname.
        StorageError: the backend failed while listing or reading.
        InvalidURLError, MissingDriverError: see :func:`dcp_fsspec.storage.urls.resolve`.
    """
    location = resolve(url, storage_options)
    target = targets.classify(location)
    report = VerifyReport(url=location.url, kind=target.kind)
    checker = _Checker(report, window_bytes, max_request_bytes, threads, progress)
    if target.kind == "checkpoint":
        checker.checkpoint(location)
    elif target.kind == "iteration":
        assert target.run is not None and target.iteration is not None
        checker.iteration(target.run, target.iteration, standalone=True)
    else:
        checker.run(location)
    return report


class _Checker:
    def __init__(
        self, report: VerifyReport, window_bytes: int, max_request_bytes: int, threads: int, progress: Progress | None
    ) -> None:
        self.report = report
        self.window_bytes = window_bytes
        self.max_request_bytes = max_request_bytes
        self.threads = threads
        self.progress = progress

    def problem(self, url: str, item: str | None, what: str, stored: int | None = None, actual: int | None = None) -> None:
        self.report.problems.append(VerifyProblem(url, item, what, stored, actual))

    # --- a save_dirname and its iterations ------------------------------------------------------

    def run(self, root: Location) -> None:
        pointer_url = commit.pointer_url(root)
        try:
            latest = commit.read_pointer(root)
        except CorruptCheckpointError as e:
            self.problem(pointer_url, None, str(e))
            latest = None
        committed = []
        for iteration in layout.list_iterations(root):
            if self.iteration(root, iteration, standalone=False):
                committed.append(iteration)
        if latest is not None and latest not in committed:
            self.problem(pointer_url, None, f"names {layout.format_iteration(latest)}, which is not a committed iteration")
        elif latest is None and committed and not self.report.problems:
            self.report.notes.append(f"{pointer_url} does not exist: a Checkpointer would start from scratch")

    def iteration(self, run: Location, iteration: int, *, standalone: bool) -> bool:
        """Verify one iteration folder; whether it is committed."""
        folder = run.url_of(layout.iteration_path(run, iteration))
        record_url = run.url_of(posixpath.join(layout.iteration_path(run, iteration), commit.COMMIT_RECORD_NAME))
        try:
            record, keys = targets.iteration_keys(run, iteration)
        except CorruptCheckpointError as e:
            self.problem(record_url, None, str(e))
            return False
        if record is None:
            if not standalone:
                self.report.notes.append(f"skipped {folder}: not committed (a save that never finished)")
                return False
            self.problem(record_url, None, f"does not exist: {folder} is not committed (its save never finished)")
        for key in keys:
            location = targets.key_location(run, iteration, key)
            if record is not None and not commit.key_is_committed(run, iteration, key):
                self.problem(
                    location.url_of(location.join(commit.METADATA_NAME)), None,
                    f"does not exist, but {commit.COMMIT_RECORD_NAME} lists key {key!r}",
                )  # fmt: skip
                continue
            self.checkpoint(location)
        return record is not None

    # --- one DCP checkpoint ---------------------------------------------------------------------

    def checkpoint(self, location: Location) -> None:
        start = time.perf_counter()
        before = len(self.report.problems)
        self.report.checkpoints.append(location.url)
        metadata = self._metadata(location)
        if metadata is None:
            return
        sizes = self._file_sizes(location)
        records = self._records(location, metadata, sizes)
        self._check_records(location, records)
        logger.info(
            "verified %s: %d items, %d problems (%.2f s)",
            location.url, len(metadata.storage_data or {}), len(self.report.problems) - before,
            time.perf_counter() - start,
        )  # fmt: skip

    def _metadata(self, location: Location) -> Metadata | None:
        path = location.join(commit.METADATA_NAME)
        url = location.url_of(path)
        try:
            raw = location.fs.cat_file(path)
        except FileNotFoundError:
            self.problem(url, None, "does not exist")
            return None
        except OSError as e:
            raise StorageError(f"cannot read {url}: {e}") from e
        self.report.bytes_read += len(raw)
        try:
            metadata = pickle.loads(raw)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is damaged
            self.problem(url, None, f"cannot be unpickled ({len(raw)} bytes: {type(e).__name__}: {e})")
            return None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            self.problem(url, None, f"does not hold DCP metadata with storage data (found {type(metadata).__name__})")
            return None
        return metadata

    def _file_sizes(self, location: Location) -> dict[str, int]:
        location.fs.invalidate_cache(location.path)
        try:
            found = location.fs.find(location.path, detail=True)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise StorageError(f"cannot list {location.url}: {e}") from e
        return {path: int(info.get("size") or 0) for path, info in found.items()}

    def _records(self, location: Location, metadata: Metadata, sizes: dict[str, int]) -> list[_Record]:
        """The tensor records to read; problems for entries that are missing or do not fit."""
        storage = metadata.storage_data
        self.report.items += len(storage)
        # Every chunk .metadata describes must have a place in a data file.
        for fqn, meta in metadata.state_dict_metadata.items():
            indices = (
                [MetadataIndex(fqn)] if isinstance(meta, BytesStorageMetadata)
                else [MetadataIndex(fqn, chunk.offsets) for chunk in meta.chunks]
            )  # fmt: skip
            for index in indices:
                if index not in storage:
                    self.problem(location.url_of(location.join(commit.METADATA_NAME)), fqn, "has no storage entry")
        by_place: dict[tuple[str, int, int], _Record] = {}
        missing_files: dict[str, list[str]] = {}
        for index, info in storage.items():
            path = location.join(info.relative_path)
            url = location.url_of(path)
            if path not in sizes:
                missing_files.setdefault(url, []).append(index.fqn)
                continue
            end = info.offset + info.length
            if sizes[path] < end:
                self.problem(
                    url, index.fqn,
                    f"the file is {sizes[path]} bytes, too short for this item at bytes [{info.offset}, {end})",
                )  # fmt: skip
                continue
            tensor_meta = metadata.state_dict_metadata.get(index.fqn)
            if not isinstance(tensor_meta, TensorStorageMetadata) or info.transform_descriptors:
                self.report.unchecked += 1  # a pickled object, or transformed bytes: nothing to compare
                continue
            chunk = next((c for c in tensor_meta.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
            key = (path, info.offset, info.length)
            if key not in by_place:
                by_place[key] = _Record(
                    path, url, info.offset, info.length, index.fqn, tensor_meta.properties.dtype,
                    None if chunk is None else tuple(chunk.sizes),
                )  # fmt: skip
        for url, fqns in missing_files.items():
            shown = ", ".join(sorted(fqns)[:5]) + (f" and {len(fqns) - 5} more" if len(fqns) > 5 else "")
            self.problem(url, None, f"does not exist; .metadata places {len(fqns)} item(s) in it: {shown}")
        return sorted(by_place.values(), key=lambda r: (r.path, r.offset))

    def _check_records(self, location: Location, records: list[_Record]) -> None:
        spans = plan_spans(
            [(r.path, r.offset, r.end) for r in records], max_gap=64 * 1024, max_span=self.max_request_bytes
        )
        if self.progress is not None:
            self.progress.add_total(sum(s.size for s in spans))
        cursor = 0
        checks: dict[int, _RecordCheck] = {}
        try:
            for span, data in fetch_in_order(location.fs, spans, window_bytes=self.window_bytes, threads=self.threads):
                self.report.bytes_read += len(data)
                if self.progress is not None:
                    self.progress.advance(span.size)
                view = memoryview(data)[: span.size]
                got_end = span.start + len(view)
                while cursor < len(records) and (records[cursor].path, records[cursor].end) <= (span.path, span.start):
                    cursor += 1
                i = cursor
                while i < len(records) and records[i].path == span.path and records[i].offset < span.end:
                    rec = records[i]
                    lo, hi = max(rec.offset, span.start), min(rec.end, got_end)
                    if lo < hi:
                        check = checks.setdefault(i, _RecordCheck(rec))
                        check.feed(view[lo - span.start : hi - span.start])
                    i += 1
        except FileNotFoundError as e:
            raise StorageError(f"a data file of {location.url} disappeared while verifying it: {e}") from e
        except DcpFsspecError:
            raise
        except OSError as e:
            raise StorageError(f"cannot read the data files of {location.url}: {e}") from e
        for i, rec in enumerate(records):
            check = checks.get(i) or _RecordCheck(rec)
            outcome = check.finish()
            if outcome is _CHECKED:
                self.report.tensors_checked += 1
            elif outcome is _UNCHECKED:
                self.report.unchecked += 1
            else:
                self.problem(rec.url, rec.fqn, outcome.what, outcome.stored, outcome.actual)


@dataclass(frozen=True)
class _Record:
    """One tensor record and what ``.metadata`` says it holds."""

    path: str
    url: str
    offset: int
    length: int
    fqn: str
    dtype: torch.dtype
    sizes: tuple[int, ...] | None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class _Outcome:
    """How one record's check ended: checked, unchecked (no CRC recorded), or a problem."""

    what: str
    stored: int | None = None
    actual: int | None = None


_CHECKED = _Outcome("checked")
_UNCHECKED = _Outcome("no checksum recorded")


class _RecordCheck:
    """Receives one record's bytes in order, CRCs the tensor data, reads the stored CRC."""

    def __init__(self, record: _Record) -> None:
        self.record = record
        self.received = 0
        self._head = bytearray()
        self._layout: RecordLayout | None = None
        self._crc = 0
        self._tail = bytearray()
        self._whole: bytearray | None = None  # only for records our parser does not know
        self._error: str | None = None

    def feed(self, piece: memoryview) -> None:
        start = self.received
        self.received += len(piece)
        if self._error is not None:
            return
        if self._whole is not None:
            self._whole += piece
            return
        if self._layout is None:
            # Parse from the piece itself when it holds the whole header (the usual case); only
            # a header split across pieces is accumulated.
            if self._head:
                self._head += piece
            head = memoryview(self._head) if self._head else piece
            try:
                parsed = parse_layout(head)
            except RecordFormatError as e:
                if self.record.length > _MAX_WHOLE:
                    self._error = f"the record's header is not a torch.save tensor archive ({e})"
                else:
                    self._whole, self._head = bytearray(head), bytearray()
                return
            if parsed is None:
                if not self._head:
                    self._head += piece
                if len(self._head) > _MAX_HEADER:
                    self._error = f"no readable tensor header in the first {len(self._head)} bytes of the record"
                return
            self._layout, self._head = parsed, bytearray()
            self._take(0, head)  # everything received so far, now that we know where the data is
            return
        self._take(start, piece)

    def _take(self, start: int, piece: memoryview) -> None:
        assert self._layout is not None
        layout = self._layout
        end = start + len(piece)
        lo, hi = max(start, layout.data_start), min(end, layout.data_end)
        if lo < hi:
            self._crc = zlib.crc32(piece[lo - start : hi - start], self._crc)
        if end > layout.data_end and len(self._tail) < _CRC_TAIL:
            at = max(start, layout.data_end)
            self._tail += piece[at - start : at - start + _CRC_TAIL - len(self._tail)]

    def finish(self) -> _Outcome:
        """:data:`_CHECKED` if the CRC matched, :data:`_UNCHECKED` if none was recorded, else a problem."""
        rec = self.record
        if self._error is not None:
            return _Outcome(self._error)
        if self.received < rec.length:
            return _Outcome(f"the file ended after {self.received} of the record's {rec.length} bytes")
        if self._whole is not None:
            return self._finish_with_torch_load(bytes(self._whole))
        layout = self._layout
        if layout is None:
            return _Outcome("the record is too short to hold a tensor header")
        spec = layout.spec
        if spec.dtype != rec.dtype or (rec.sizes is not None and spec.size != rec.sizes):
            expected = "?" if rec.sizes is None else list(rec.sizes)
            return _Outcome(f"the record holds {spec.dtype} {list(spec.size)} but .metadata says {rec.dtype} {expected}")
        if layout.data_end > rec.length:
            return _Outcome(f"the record is {rec.length} bytes but its tensor data ends at byte {layout.data_end}")
        if spec.nbytes == 0:
            return _UNCHECKED
        if layout.crc_in_header is not None:
            stored = layout.crc_in_header
        else:
            try:
                stored = descriptor_crc(self._tail)
            except RecordFormatError:
                return _Outcome("no zip data descriptor (with the CRC-32) after the tensor data")
        if stored == 0:
            return _UNCHECKED
        if stored != self._crc:
            return _Outcome("checksum mismatch: the tensor bytes are not what was written", stored, self._crc)
        return _CHECKED

    def _finish_with_torch_load(self, raw: bytes) -> _Outcome:
        try:
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch.load's errors vary; all mean "not a tensor"
            return _Outcome(f"not a readable torch.save record ({type(e).__name__}: {e})")
        if not isinstance(tensor, torch.Tensor):
            return _Outcome(f"the record holds a {type(tensor).__name__}, not a tensor")
        return _UNCHECKED


# --- the subcommand ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url", help="a DCP checkpoint, an iteration folder (every key), or a save_dirname (every committed iteration)"
    )
    _cli.add_storage_options(parser)
    _cli.add_json_flag(parser)


def main(args: argparse.Namespace) -> int:
    with Progress("verifying") as progress:
        report = verify(args.url, _cli.storage_options(args.storage_options), progress=progress)
    if args.json:
        _cli.print_json(report.to_dict())
    else:
        for note in report.notes:
            print(f"note: {note}")
        for problem in report.problems:
            print(f"PROBLEM {problem}")
        summary = (
            f"{len(report.checkpoints)} checkpoint(s), {report.items} items, {report.tensors_checked} tensors "
            f"checked against their CRC-32, {report.unchecked} without a checksum, {human_bytes(report.bytes_read)} read"
        )
        print(f"{'OK' if report.ok else f'{len(report.problems)} PROBLEM(S) in'} {report.url}: {summary}")
    return _cli.EXIT_OK if report.ok else _cli.EXIT_PROBLEM
