"""Streaming one tensor larger than the export's buffer, a piece of rows at a time.

Each record of a tensor is a ``torch.save`` archive whose tensor bytes are row-major after a
short header. The export works in four steps:

1. Read every record's header, and find where its bytes start.
2. For each piece of rows, read only those rows' byte ranges from the records that hold them.
3. Cast the piece to the output dtype where the export asks for another.
4. Check each record's CRC-32 once its last byte was read (its bytes are read in order).

A tensor with a record that cannot be read in ranges (a compressed one, an archive we do not
parse) is left to :func:`~dcp_fsspec.tools.safetensors.batches.read_batch`, which reads it whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from dcp_fsspec.errors import CorruptCheckpointError, RecordFormatError
from dcp_fsspec.storage.backends.base import InPlaceFiles, RangeReader
from dcp_fsspec.storage.format.record_layout import RecordLayout, parse_layout
from dcp_fsspec.storage.format.tensor_records import tensor_bytes
from dcp_fsspec.storage.read.reader import FsspecStorageReader
from dcp_fsspec.storage.read.record_stream import CRC_TAIL, RecordDecoder, RecordPlace
from dcp_fsspec.storage.transport.workers import Workers
from dcp_fsspec.tools.safetensors.batches import Entry, carve, cast_into, numel

_HEAD_BYTES = 64 * 1024  # a record's zip header and data.pkl are a few hundred bytes


@dataclass
class _Record:
    """One record of the tensor: the block of the tensor it holds, where its bytes start, its decoder."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data_start: int  # in the file
    row_bytes: int
    decoder: RecordDecoder

    @property
    def end_row(self) -> int:
        return self.offsets[0] + self.sizes[0]


class TensorPieces:
    """One tensor's output bytes, a piece of rows at a time; close it when done.

    A record that spans every column of its rows is one contiguous range of the tensor's bytes:
    the tensor is then read as one long row of elements, so a piece never holds a whole row.
    """

    def __init__(
        self,
        entry: Entry,
        shape: tuple[int, ...],
        records: list[_Record],
        files: RangeReader,
        reader: FsspecStorageReader,
        url: str,
    ) -> None:
        self.entry = entry
        self.shape = shape
        self.records = records
        self.files = files
        self.url = url
        self._request = reader.settings.max_request_bytes
        self._pool = Workers("export-read", reader.settings.threads)

    def loaded(self, buffer_bytes: int) -> Iterator[list[tuple[Entry, torch.Tensor]]]:
        """The tensor's rows in order, in pieces of about ``buffer_bytes``, in the output dtype.

        Each piece is read when the next is asked for, and the generator keeps no reference to
        a piece once it is handed out: the caller alone decides how long each buffer lives.
        """
        row = numel(self.shape[1:]) * self.entry.source_dtype.itemsize
        step = max(1, buffer_bytes // max(row, 1))
        for r0 in range(0, self.shape[0], step):
            yield [(self.entry, self._piece(r0, min(self.shape[0], r0 + step)))]

    def _piece(self, r0: int, r1: int) -> torch.Tensor:
        e = self.entry
        (source,), (output,) = carve(
            [Entry(e.fqn, e.name, (r1 - r0, *self.shape[1:]), e.source_dtype, e.dtype)]
        )
        self._fill(source, r0, r1)
        if output is not source:
            cast_into(e, source, output, self.url)
        return output

    def close(self) -> None:
        self._pool.close()
        self.files.close()

    def _fill(self, source: torch.Tensor, r0: int, r1: int) -> None:
        """Read rows ``[r0, r1)`` of every record holding some into ``source``, concurrently."""
        started = []
        for rec in self.records:
            a, b = max(r0, rec.offsets[0]), min(r1, rec.end_row)
            if a >= b:
                continue
            dest = source[a - r0 : b - r0]
            for dim in range(1, len(rec.sizes)):
                dest = dest.narrow(dim, rec.offsets[dim], rec.sizes[dim])
            buf = dest if dest.is_contiguous() else torch.empty((b - a, *rec.sizes[1:]), dtype=dest.dtype)
            view = tensor_bytes(buf)
            start = rec.data_start + (a - rec.offsets[0]) * rec.row_bytes
            reads = [
                (
                    p,
                    self._pool.submit(
                        _read_into, self.files, rec.decoder.place.path, start + p, view[p : p + self._request]
                    ),
                )
                for p in range(0, len(view), self._request)
            ]
            started.append((rec, dest, buf, view, reads, b == rec.end_row))
        for rec, dest, buf, view, reads, last in started:
            for p, read in reads:
                if read.result() != len(view[p : p + self._request]):
                    raise CorruptCheckpointError(
                        f"{rec.decoder.place.url} is truncated: {self.entry.fqn!r} needs bytes up to "
                        f"{rec.data_start + len(view)}; restore it or export another checkpoint"
                    )
            rec.decoder.feed(view)
            if buf is not dest:
                dest.copy_(buf)
            if last:
                self._check(rec)

    def _check(self, rec: _Record) -> None:
        """After a record's last tensor byte: its CRC-32, as a load checks it."""
        place, layout = rec.decoder.place, rec.decoder.layout
        assert layout is not None
        tail = min(CRC_TAIL, place.length - layout.data_end)
        if tail > 0:
            rec.decoder.feed(memoryview(self.files.read(place.path, tail, place.offset + layout.data_end)))
        fault = rec.decoder.check_streamed()
        if fault is not None:
            raise fault.exception(place, repr(self.entry.fqn))


def open_pieces(
    reader: FsspecStorageReader, metadata: Metadata, entry: Entry, url: str
) -> TensorPieces | None:
    """``entry``'s tensor ready to stream in pieces, or None where a record cannot be read in ranges.

    Raises:
        CorruptCheckpointError: the records do not tile the tensor, or a header is damaged.
    """
    meta = metadata.state_dict_metadata[entry.fqn]
    assert isinstance(meta, TensorStorageMetadata)
    infos = [reader.storage_data.get(MetadataIndex(entry.fqn, c.offsets)) for c in meta.chunks]
    stored = [i for i in infos if i is not None and not i.transform_descriptors]
    if not entry.shape or len(stored) != len(infos):
        return None
    shape, blocks = _blocks(
        entry, [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks], reader.location.url
    )
    location = reader.location
    paths = [location.join(i.relative_path) for i in stored]
    places = [RecordPlace(path, location.url_of(path), i.offset, i.length) for path, i in zip(paths, stored)]
    files = location.backend.in_place_files() or location.backend.range_reader()
    try:
        with Workers("export-read", reader.settings.threads) as pool:
            heads = [pool.submit(files.read, p.path, min(p.length, _HEAD_BYTES), p.offset) for p in places]
            records = []
            for place, head, block, chunk in zip(places, heads, blocks, meta.chunks):
                layout = _layout(head.result(), entry, tuple(chunk.sizes))
                if layout is None:
                    files.close()
                    return None
                records.append(
                    _record(
                        place,
                        head.result()[: layout.data_start],
                        layout,
                        block,
                        reader.settings.verify_checksums,
                    )
                )
    except BaseException:
        files.close()
        raise
    return TensorPieces(entry, shape, records, files, reader, url)


def check_tiling(entry: Entry, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], url: str) -> None:
    """Refuse chunks that leave ``entry``'s shape or do not add up to it (a damaged or crafted
    ``.metadata``). Buffers are zeroed too: overlapping chunks that add up can still leave a gap,
    and a gap exports zeros, never this process's memory.

    Raises:
        CorruptCheckpointError: naming the tensor and ``url``.
    """
    shape = entry.shape
    inside = all(
        len(o) == len(s) == len(shape) and all(0 <= a and a + n <= d for a, n, d in zip(o, s, shape))
        for o, s in chunks
    )
    if not inside or sum(numel(s) for _, s in chunks) != numel(shape):
        raise CorruptCheckpointError(
            f"the .metadata of {url} gives {entry.fqn!r} chunks that do not tile its {list(shape)} shape: "
            "the checkpoint is damaged or crafted; export another checkpoint"
        )


def _blocks(
    entry: Entry, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], url: str
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The shape the tensor is read in, and each record's block of it.

    Records that each span every column of their rows make the tensor one long row.
    """
    shape = entry.shape
    check_tiling(entry, chunks, url)
    if all(s[1:] == shape[1:] for _, s in chunks):
        row = numel(shape[1:])
        return (numel(shape),), [((o[0] * row,), (s[0] * row,)) for o, s in chunks]
    return shape, chunks


def _layout(head: bytes, entry: Entry, sizes: tuple[int, ...]) -> RecordLayout | None:
    """Where the record's row-major bytes of ``sizes`` start, or None where it holds anything else."""
    try:
        layout = parse_layout(head)
    except RecordFormatError:
        return None
    if (
        layout is None
        or layout.spec.torch_dtype != entry.source_dtype
        or layout.spec.size != sizes
        or not layout.spec.is_dense
    ):
        return None
    return layout


def _record(
    place: RecordPlace,
    header: bytes,
    layout: RecordLayout,
    block: tuple[tuple[int, ...], tuple[int, ...]],
    checksum: bool,
) -> _Record:
    """The record, its decoder fed its ``header`` (the bytes before its tensor's)."""
    if layout.data_end > place.length:
        raise CorruptCheckpointError(
            f"the record in {place.url} at bytes [{place.offset}, {place.end}) is shorter than its tensor "
            f"({layout.data_end} bytes); restore the file or export another checkpoint"
        )
    decoder = RecordDecoder(place, checksum=checksum)
    decoder.feed(memoryview(header))
    offsets, sizes = block
    return _Record(
        offsets,
        sizes,
        place.offset + layout.data_start,
        numel(sizes[1:]) * layout.spec.dtype.itemsize,
        decoder,
    )


def _read_into(files: RangeReader, path: str, offset: int, view: memoryview) -> int:
    """Fill ``view`` from ``path`` at ``offset``; the bytes read."""
    if isinstance(files, InPlaceFiles):
        return files.read_into(path, offset, view)
    data = files.read(path, len(view), offset)
    view[: len(data)] = data
    return len(data)
