"""Verifying one DCP checkpoint on storage without loading it: every file, record and CRC-32.

What is checked: ``.metadata`` unpickles (:func:`~dcp_fsspec.storage.format.metadata_file.read_metadata`, as a load reads
it: only DCP metadata's classes, every entry inside the folder at a real offset and length); every tensor chunk it lists has a storage entry; every data file an entry names exists and
is long enough for every item in it; every tensor record decodes with the decoder loads use
(:class:`~dcp_fsspec.storage.read.record_stream.RecordDecoder`), holds the dtype and shape ``.metadata`` promises, and its
bytes match the CRC-32 stored in the record (CRC 0 means "not recorded" and is counted, not
failed). A transformed record (compressed: ``transform_descriptors`` in its storage entry) is
undone first, with :func:`~dcp_fsspec.storage.format.transforms.untransform` as a load does, and never expands past what
``.metadata`` says its tensor takes (a zstd bomb is a problem, not an allocation); zstd's frame
checksum and then the record's CRC-32 are checked. Pickled (non-tensor) entries are checked for
presence and size only: nothing in the format records a checksum for them.

It streams: the tensor records are read in file order as coalesced ranges through
:func:`~dcp_fsspec.storage.read.fetch.fetch_in_order`, so memory stays within ``window_bytes`` whatever the
checkpoint's size; only a record too odd for our parser (and at most 64 MiB) is held whole, to
try ``torch.load`` on it, and a transformed record is held whole (it is one unit: its bytes
mean nothing until its transforms are undone) and judged, and let go, as soon as it is complete.

torch is not imported for a checkpoint of plain records: ``.metadata`` is read into
:mod:`~dcp_fsspec.storage.format.metadata_standins`, and records are parsed by :mod:`~dcp_fsspec.storage.format.record_layout`. Only a transformed
record, or one held whole, imports it.

References are followed (an incremental save's records kept in another checkpoint, see
:mod:`~dcp_fsspec.storage.format.references`): each referenced file is checked like the checkpoint's own, its folder
listed once, and the bytes of records of its own and referenced are counted apart. A reference
to a missing file, or to a folder without ``.metadata``, is a problem naming both checkpoints.

Damage is reported, not raised: each :class:`VerifyProblem` names the file, the item, the error
a load would raise and, for a checksum mismatch, both CRC-32s. This module knows one checkpoint
folder; iterations, commit records and the pointer belong to the checkpoint layer, and
:func:`dcp_fsspec.tools.verify.verify` walks them.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import fsspec

from dcp_fsspec.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingDriverError,
    StorageError,
)
from dcp_fsspec.storage.checkpoint_files.self_contained import folder_sizes
from dcp_fsspec.storage.format.metadata_file import read_metadata
from dcp_fsspec.storage.format.metadata_standins import (
    BytesStorageMetadata,
    DType,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
    dtype_name,
)
from dcp_fsspec.storage.format.names import METADATA_NAME
from dcp_fsspec.storage.format.references import is_reference, referenced_folders
from dcp_fsspec.storage.read.fetch import Span, fetch_in_order, plan_spans
from dcp_fsspec.storage.read.record_stream import (
    RecordDecoder,
    RecordFault,
    RecordPlace,
    crc_note,
    feed_records,
)
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, RetryPolicy
from dcp_fsspec.storage.transport.urls import Location, resolve

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.planner import ReadItem

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
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
        error: the name of the :mod:`dcp_fsspec.errors` class a load of this item raises
            (``ChecksumMismatchError`` for a checksum mismatch).
    """

    url: str
    item: str | None
    what: str
    stored_crc32: int | None = None
    actual_crc32: int | None = None
    error: str = CorruptCheckpointError.__name__

    def __str__(self) -> str:
        return f"{self.url}: {self.item + ': ' if self.item else ''}{self.what}{crc_note(self.stored_crc32, self.actual_crc32)}"


@dataclass
class VerifyReport:
    """What a verification checked and found.

    Attributes:
        url: the URL verified.
        kind: ``"checkpoint"``, ``"iteration"`` or ``"run"`` (a save_dirname).
        checkpoints: the URL of every DCP checkpoint verified.
        items: entries listed in their ``.metadata`` files.
        tensors_checked: tensor records whose CRC-32 was compared.
        unchecked: records present but without a checksum to compare (pickled objects,
            tensors saved without one).
        objects: of those, the pickled (non-tensor) entries, which never have one.
        bytes_read: bytes of data files downloaded.
        own_bytes: bytes of the records in the checkpoints' own data files.
        referenced_bytes: bytes of the records in other checkpoints' files (references).
        problems: everything found wrong; empty when the checkpoint is sound.
        notes: things worth knowing that are not damage (e.g. uncommitted folders skipped).
    """

    url: str
    kind: str
    checkpoints: list[str] = field(default_factory=list)
    items: int = 0
    tensors_checked: int = 0
    unchecked: int = 0
    objects: int = 0
    bytes_read: int = 0
    own_bytes: int = 0
    referenced_bytes: int = 0
    problems: list[VerifyProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def add(self, other: VerifyReport) -> None:
        """Count ``other`` (one of the checkpoints verified) into this report."""
        self.checkpoints += other.checkpoints
        self.items += other.items
        self.tensors_checked += other.tensors_checked
        self.unchecked += other.unchecked
        self.objects += other.objects
        self.bytes_read += other.bytes_read
        self.own_bytes += other.own_bytes
        self.referenced_bytes += other.referenced_bytes
        self.problems += other.problems
        self.notes += other.notes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


class ProgressSink(Protocol):
    """What a verification reports its progress to (e.g. :class:`dcp_fsspec.tools.progress.Progress`)."""

    def add_total(self, n: int) -> None: ...

    def advance(self, n: int) -> None: ...


def verify_checkpoint(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    fs: fsspec.AbstractFileSystem | None = None,
    window_bytes: int = 64 * MiB,
    max_request_bytes: int = 16 * MiB,
    threads: int = 8,
    retry: RetryPolicy | None = DEFAULT_RETRY,
    progress: ProgressSink | None = None,
    trust_checkpoint: bool = False,
    references: bool = False,
) -> VerifyReport:
    """Check the DCP checkpoint folder at ``url`` (``.metadata`` and its data files).

    Args:
        url: the checkpoint folder: any fsspec URL or a local path.
        storage_options: options for the fsspec filesystem.
        fs: a ready fsspec filesystem to use instead of one built from the URL.
        window_bytes: downloaded-but-not-yet-checked data held at once (bounds memory).
        max_request_bytes: the largest single ranged read.
        threads: concurrent reads on filesystems without an async API.
        retry: how reads are retried (see :class:`~dcp_fsspec.storage.transport.retry.RetryPolicy`);
            ``None``: only the driver's own retries.
        progress: told the bytes to read, and advanced as they are, if given.
        trust_checkpoint: unpickle ``.metadata`` in full, whatever classes it names (runs any
            code it holds). By default a ``.metadata`` naming a class DCP metadata does not
            consist of is reported as a problem, and nothing it names is run. Non-tensor entries
            are never unpickled here (only their presence and size are checked).
        references: follow references to sibling checkpoints (``../step-10/…``, a plain
            layout's incremental saves); without it such a reference is a problem. References
            to another iteration's same key are always followed.

    Returns:
        The report (``kind`` ``"checkpoint"``); ``report.ok`` is False when anything was found
        wrong, a missing ``.metadata`` included.

    Raises:
        StorageError: the backend failed while listing or reading.
        InvalidURLError, MissingDriverError: see :func:`dcp_fsspec.storage.transport.urls.resolve`; also a
            transformed record needs a package not installed here (zstandard).
    """
    location = resolve(url, storage_options, fs, retry=retry)
    report = VerifyReport(url=location.url, kind="checkpoint")
    _Checkpoint(
        location, report, window_bytes, max_request_bytes, threads, progress, trust_checkpoint, references
    ).verify()
    return report


@dataclass
class _TensorRecord(RecordPlace):
    """One tensor record and what ``.metadata`` says it holds."""

    fqn: str
    dtype: DType
    sizes: tuple[int, ...] | None
    index: MetadataIndex
    transforms: tuple[str, ...] = ()
    limit: int = 0  # for a transformed record: the most bytes it may expand to


@dataclass
class _Checkpoint:
    location: Location
    report: VerifyReport
    window_bytes: int
    max_request_bytes: int
    threads: int
    progress: ProgressSink | None
    trust_checkpoint: bool = False
    references: bool = False
    _transforms: _StorageReaderTransforms | None = None

    @property
    def transforms(self) -> _StorageReaderTransforms:
        """torch's read transforms, made (and torch imported) for the first transformed record."""
        if self._transforms is None:
            from dcp_fsspec.storage.format.transforms import reader_transforms

            self._transforms = reader_transforms(None)
        return self._transforms

    @property
    def metadata_url(self) -> str:
        return self.location.url_of(self.location.join(METADATA_NAME))

    def problem(
        self, url: str, item: str | None, what: str, *, error: type[Exception] = CorruptCheckpointError
    ) -> None:
        self.report.problems.append(VerifyProblem(url, item, what, error=error.__name__))

    def verify(self) -> None:
        start = time.perf_counter()
        self.report.checkpoints.append(self.location.url)
        metadata = self._metadata()
        if metadata is None:
            return
        records = self._records(metadata, self._file_sizes(metadata))
        self._check_records(records)
        logger.info(
            "verified %s: %d items, %d problems (%.2f s)",
            self.location.url,
            self.report.items,
            len(self.report.problems),
            time.perf_counter() - start,
        )

    def _metadata(self) -> Metadata | None:
        try:
            metadata = read_metadata(
                self.location,
                trust_checkpoint=self.trust_checkpoint,
                references=self.references,
                stand_ins=True,
            )
        except CheckpointNotFoundError:
            self.problem(self.metadata_url, None, "does not exist", error=CheckpointNotFoundError)
            return None
        except CorruptCheckpointError as e:
            self.problem(self.metadata_url, None, str(e))
            return None
        if not isinstance(metadata.storage_data, dict):
            self.problem(self.metadata_url, None, "holds DCP metadata without storage data")
            return None
        return metadata

    def _file_sizes(self, metadata: Metadata) -> dict[str, int]:
        """Every file of the checkpoint's folder, and of each folder it refers to: path → size."""
        fs, path = self.location.fs, self.location.path
        fs.invalidate_cache(path)
        try:
            with storage_errors("list", self.location.url):
                found = fs.find(path, detail=True)
        except FileNotFoundError:
            found = {}
        sizes = {path: int(info.get("size") or 0) for path, info in found.items()}
        names = (info.relative_path for info in metadata.storage_data.values())
        return sizes | folder_sizes(
            self.location, (self.location.join(name) for name in referenced_folders(names))
        )

    def _records(self, metadata: Metadata, sizes: dict[str, int]) -> list[_TensorRecord]:
        """The tensor records to read; problems for entries that are missing or do not fit."""
        storage = metadata.storage_data
        self.report.items += len(storage)
        # Every chunk .metadata describes must have a place in a data file.
        for fqn, meta in metadata.state_dict_metadata.items():
            indices = (
                [MetadataIndex(fqn)]
                if isinstance(meta, BytesStorageMetadata)
                else [MetadataIndex(fqn, chunk.offsets) for chunk in meta.chunks]
            )
            for index in indices:
                if index not in storage:
                    self.problem(self.metadata_url, fqn, "has no storage entry")
        by_place: dict[tuple[str, int, int], _TensorRecord] = {}
        missing_files: dict[str, list[str]] = {}
        counted: set[tuple[str, int, int]] = set()
        for index, info in storage.items():
            path = self.location.join(info.relative_path)
            url = self.location.url_of(path)
            if path not in sizes or self._unreferable(info.relative_path, sizes):
                missing_files.setdefault(path, []).append(index.fqn)
                continue
            if (path, info.offset, info.length) not in counted:
                counted.add((path, info.offset, info.length))
                if is_reference(info.relative_path):
                    self.report.referenced_bytes += info.length
                else:
                    self.report.own_bytes += info.length
            end = info.offset + info.length
            if sizes[path] < end:
                self.problem(
                    url,
                    index.fqn,
                    f"the file is {sizes[path]} bytes, too short for this item at bytes [{info.offset}, {end})",
                )
                continue
            tensor_meta = metadata.state_dict_metadata.get(index.fqn)
            if not isinstance(tensor_meta, TensorStorageMetadata):
                self.report.unchecked += 1  # a pickled object: nothing to compare
                self.report.objects += 1
                continue
            chunk = next(
                (c for c in tensor_meta.chunks if tuple(c.offsets) == tuple(index.offset or ())), None
            )
            key = (path, info.offset, info.length)
            if key not in by_place:
                transforms = tuple(info.transform_descriptors or ())
                by_place[key] = _TensorRecord(
                    path,
                    url,
                    info.offset,
                    info.length,
                    index.fqn,
                    tensor_meta.properties.dtype,
                    None if chunk is None else tuple(chunk.sizes),
                    index,
                    transforms,
                    _limit(tensor_meta, index) if transforms else 0,
                )
        for path, fqns in missing_files.items():
            shown = ", ".join(sorted(fqns)[:5]) + (f" and {len(fqns) - 5} more" if len(fqns) > 5 else "")
            what = f"{self._missing(path, sizes)}; .metadata places {len(fqns)} item(s) in it: {shown}"
            self.problem(self.location.url_of(path), None, what)
        return sorted(by_place.values(), key=lambda r: (r.path, r.offset))

    def _unreferable(self, name: str, sizes: dict[str, int]) -> bool:
        """Whether ``name`` is a reference into a folder that is not a checkpoint (no ``.metadata``)."""
        folder = posixpath.dirname(self.location.join(name))
        return is_reference(name) and posixpath.join(folder, METADATA_NAME) not in sizes

    def _missing(self, path: str, sizes: dict[str, int]) -> str:
        """What is wrong with the data file at ``path``, which is not there to read."""
        if path.startswith(self.location.path.rstrip("/") + "/"):
            return "does not exist"
        why = (
            "does not exist"
            if path not in sizes
            else (
                f"is in {self.location.url_of(posixpath.dirname(path))}, which is not a committed checkpoint "
                f"(no {METADATA_NAME})"
            )
        )
        return f"{why}, but the checkpoint {self.location.url} refers to it (an incremental save's base)"

    def _check_records(self, records: list[_TensorRecord]) -> None:
        spans = plan_spans(
            [(r.path, r.offset, r.end) for r in records], max_gap=64 * 1024, max_span=self.max_request_bytes
        )
        if self.progress is not None:
            self.progress.add_total(sum(s.size for s in spans))
        decoders: dict[int, RecordDecoder] = {}

        def start(i: int) -> RecordDecoder:
            rec = records[i]
            decoders[i] = (
                _TransformedDecoder(rec, self.transforms)
                if rec.transforms
                else RecordDecoder(rec, max_whole=_MAX_WHOLE)
            )
            return decoders[i]

        fetched = fetch_in_order(
            self.location.fs,
            spans,
            window_bytes=self.window_bytes,
            threads=self.threads,
            retry=self.location.retry,
        )
        try:
            with storage_errors("read the data files of", self.location.url):
                feed_records(records, self._counted(fetched), start)
        except FileNotFoundError as e:
            raise StorageError(
                f"a data file of {self.location.url} disappeared while verifying it: {e}"
            ) from e
        for i, rec in enumerate(records):
            decoder = decoders.get(i)
            fault = _judge(rec, decoder)
            if fault is not None:
                self.report.problems.append(
                    VerifyProblem(
                        rec.url,
                        rec.fqn,
                        fault.what,
                        fault.stored_crc32,
                        fault.actual_crc32,
                        fault.error.__name__,
                    )
                )
            elif decoder is not None and decoder.compared:
                self.report.tensors_checked += 1
            else:
                self.report.unchecked += 1

    def _counted(
        self, fetched: Iterator[tuple[Span, bytes | bytearray]]
    ) -> Iterator[tuple[Span, bytes | bytearray]]:
        for span, data in fetched:
            self.report.bytes_read += len(data)
            if self.progress is not None:
                self.progress.advance(span.size)
            yield span, data


def _limit(entry: TensorStorageMetadata, index: MetadataIndex) -> int:
    from dcp_fsspec.storage.format.transforms import untransformed_limit

    return untransformed_limit(entry, index)


class _TransformedDecoder(RecordDecoder):
    """Holds a transformed record whole; once complete, undoes its transforms (within the
    record's limit), decodes and checks it, and keeps only the verdict (:attr:`fault`, or the
    tensor's dtype and shape in :attr:`found`) — one transformed record in memory at a time."""

    def __init__(self, rec: _TensorRecord, transforms: _StorageReaderTransforms) -> None:
        super().__init__(rec)
        self.rec = rec
        self.transforms = transforms
        self.found: tuple[object, tuple[int, ...]] | None = None
        self.hold_whole()

    def feed(self, view: memoryview) -> None:
        super().feed(view)
        if self.done and self.whole is not None:
            data, self.whole = memoryview(self.whole), None
            self._judge_whole(data)

    def _judge_whole(self, data: memoryview) -> None:
        from dcp_fsspec.storage.format.transforms import missing_package, untransform

        rec = self.rec
        package = missing_package(self.transforms, rec.transforms)
        if package is not None:  # not damage: this machine cannot read what is there
            raise MissingDriverError(
                f"{rec.url!r} holds records saved with {list(rec.transforms)}; install {package} to "
                "verify them: pip install 'dcp-fsspec[zstd]'"
            )
        try:
            raw = untransform(self.transforms, _read_item(rec), rec.transforms, data, rec.limit)
        except Exception as e:  # noqa: BLE001 - an unknown descriptor or undecodable bytes: damage
            self.fault = RecordFault(
                f"cannot undo the transforms {list(rec.transforms)} ({type(e).__name__}: {e})"
            )
            return
        tensor = self.decode(memoryview(raw))
        if isinstance(tensor, RecordFault):
            self.fault = tensor
        else:
            self.found = (tensor.dtype, tuple(tensor.shape))


def _read_item(rec: _TensorRecord) -> ReadItem:
    """A read of the whole of ``rec``: what torch's read transforms are handed (only extensions
    of the user's own look at it)."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex as TorchIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    zeros = torch.Size([0] * len(rec.sizes or ()))
    index = TorchIndex(rec.index.fqn, rec.index.offset, rec.index.index)
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=zeros,
        storage_index=index,
        storage_offsets=zeros,
        lengths=torch.Size(rec.sizes or ()),
    )


def _judge(rec: _TensorRecord, decoder: RecordDecoder | None) -> RecordFault | None:
    """What is wrong with a tensor record once all its bytes were fed (``None``: not one came)."""
    if decoder is not None and decoder.fault is not None:
        return decoder.fault
    if decoder is None or not decoder.done:
        received = 0 if decoder is None else decoder.received
        return RecordFault(f"the file ended after {received} of the record's {rec.length} bytes")
    if isinstance(decoder, _TransformedDecoder):
        assert decoder.found is not None
        dtype, size = decoder.found
    elif decoder.whole is not None:
        tensor = decoder.decode(memoryview(decoder.whole))
        if isinstance(tensor, RecordFault):
            return tensor
        dtype, size = tensor.dtype, tuple(tensor.shape)
    else:
        assert decoder.layout is not None
        dtype, size = decoder.layout.spec.dtype, decoder.layout.spec.size
    if dtype_name(dtype) != dtype_name(rec.dtype) or (rec.sizes is not None and size != rec.sizes):
        expected = "?" if rec.sizes is None else list(rec.sizes)
        return RecordFault(f"the record holds {dtype} {list(size)} but .metadata says {rec.dtype} {expected}")
    return (
        None
        if decoder.whole is not None or isinstance(decoder, _TransformedDecoder)
        else decoder.check_streamed()
    )
