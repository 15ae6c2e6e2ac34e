"""Decoding each record of a DCP checkpoint as its bytes arrive.

Loads (:mod:`~dcp_fsspec.storage.read.reader`) and verification (:mod:`~dcp_fsspec.storage.checkpoint_files.integrity`) read the same files, so what
the bytes mean is decided once, here (``.metadata``'s are in :mod:`~dcp_fsspec.storage.format.metadata_file`).
:class:`RecordDecoder` receives one record's bytes in order: it finds the tensor's header in the
first bytes (:func:`~dcp_fsspec.storage.format.record_layout.parse_layout`), hands each piece of the tensor's bytes to a
destination (a load's target tensor, or none when only verifying) while computing their CRC-32,
and keeps the data descriptor after them, where torch's writer stores the CRC. A record it cannot
stream (an archive our parser does not know, a record a load must reshape) is held whole and
decoded once, with ``torch.load`` as the fallback (torch is imported only then: a verification
of streamed records runs without it). What is wrong with a record is a
:class:`RecordFault` naming the error class a load raises for it, so a load and a verification
reject the same damage the same way. :func:`feed_records` walks fetched spans onto the records
they hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from dcp_fsspec.errors import ChecksumMismatchError, CorruptCheckpointError, RecordFormatError
from dcp_fsspec.storage.format.crc import crc32
from dcp_fsspec.storage.format.record_layout import RecordLayout, descriptor_crc, parse_layout
from dcp_fsspec.storage.read.fetch import Span

if TYPE_CHECKING:
    import torch

MiB = 1024 * 1024
# A descriptor (signature + CRC) follows a record's data; 8 bytes are enough to read the CRC.
CRC_TAIL = 8
# A record's zip header and data.pkl are a few hundred bytes; past this there is none to find.
_MAX_HEADER = MiB


# --- records -------------------------------------------------------------------------------------


@dataclass
class RecordPlace:
    """Where one record is stored: bytes ``[offset, end)`` of the data file at ``path``."""

    path: str
    url: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class RecordFault:
    """What is wrong with one record's bytes, and the error a load raises for it.

    Attributes:
        what: what is wrong, in words.
        error: the exception class a load raises (a verification reports its name).
        stored_crc32: for a checksum mismatch, the CRC-32 stored in the record.
        actual_crc32: for a checksum mismatch, the CRC-32 of the bytes read.
    """

    what: str
    error: type[CorruptCheckpointError] = CorruptCheckpointError
    stored_crc32: int | None = None
    actual_crc32: int | None = None

    def exception(self, place: RecordPlace, fqns: str) -> CorruptCheckpointError:
        """The error a load raises, naming the file, the bytes and the entries (``fqns``)."""
        return self.error(
            f"{self.what} in {place.url!r} at bytes [{place.offset}, {place.end}) ({fqns})"
            f"{crc_note(self.stored_crc32, self.actual_crc32)}; the file is corrupt — restore it or "
            "load another checkpoint"
        )


def crc_note(stored: int | None, actual: int | None) -> str:
    """`` (stored CRC-32 0x…, read 0x…)`` for a checksum mismatch, else nothing."""
    if stored is None or actual is None:
        return ""
    return f" (stored CRC-32 {stored:#010x}, read {actual:#010x})"


class RecordDecoder:
    """Receives one record's bytes in order; streams the tensor's bytes or holds the record whole.

    Once the header is parsed, :meth:`_on_layout` decides where the tensor's bytes go: by
    default nowhere (they are only checksummed); a load overrides it to stream them into the
    target (:meth:`stream_into`) or to hold the record whole (:meth:`hold_whole`). After the
    last byte, :meth:`check_streamed` judges a streamed record and :meth:`decode` a held one.

    Args:
        place: the record.
        checksum: compute the CRC-32 of the tensor's bytes (to compare with the stored one).
        max_whole: the largest record held whole when its header cannot be parsed; a bigger
            one is a :class:`RecordFault` (``None``: no limit, for loads, which must decode it).
    """

    def __init__(self, place: RecordPlace, *, checksum: bool = True, max_whole: int | None = None) -> None:
        self.place = place
        self.checksum = checksum
        self.max_whole = max_whole
        self.received = 0
        self.layout: RecordLayout | None = None
        self.whole: bytearray | None = None
        self.fault: RecordFault | None = None  # the record cannot be decoded at all
        self.crc = 0
        self.compared = False  # a stored CRC-32 (not 0) was compared with the bytes'
        self._streaming = False
        self._dest: memoryview | None = None
        self._head = bytearray()
        self._tail = bytearray()

    @property
    def done(self) -> bool:
        return self.received >= self.place.length

    def feed(self, view: memoryview) -> None:
        start = self.received
        self.received += len(view)
        if self.fault is not None:
            return
        if self.whole is not None:
            self.whole[start : self.received] = view  # appends, until reserve_whole
        elif self._streaming:
            self._take(start, view)
        else:
            self._read_header(view)

    # --- choosing where the bytes go ---------------------------------------------------------

    def _on_layout(self, layout: RecordLayout) -> None:
        """The header is parsed: choose :meth:`stream_into` or :meth:`hold_whole`."""
        self.stream_into(None)

    def stream_into(self, dest: memoryview | None) -> None:
        """Stream the tensor's bytes into ``dest`` (its bytes, whole), or only checksum them."""
        self._streaming, self._dest = True, dest

    def hold_whole(self) -> None:
        """Keep every byte of the record (from the first), to decode it once complete.

        The buffer grows as the bytes arrive (:meth:`feed` appends), so a ``.metadata`` that
        claims a huge record costs the bytes actually stored, not the claim, before the
        truncation is noticed; :meth:`reserve_whole` sizes it at once where the size is known.
        """
        head = self._head
        self.whole, self._head = bytearray(head), bytearray()

    def reserve_whole(self) -> memoryview:
        """The held buffer at the record's full length (the caller checked the bytes exist),
        as a view from the first byte not yet received, to be filled in place."""
        assert self.whole is not None
        if len(self.whole) < self.place.length:
            full = bytearray(self.place.length)
            full[: len(self.whole)] = self.whole
            self.whole = full
        return memoryview(self.whole)[self.received :]

    def _read_header(self, view: memoryview) -> None:
        # Parse from the piece itself when it holds the whole header (the usual case); only a
        # header split across pieces is accumulated.
        if self._head:
            self._head += view
        head = memoryview(self._head) if self._head else view
        try:
            layout = parse_layout(head)
            if layout is None and len(head) >= min(self.place.length, _MAX_HEADER):
                raise RecordFormatError(f"no tensor header in the record's first {len(head)} bytes")
        except RecordFormatError as e:
            self._unparsable(head, e)
            return
        if layout is None:
            if not self._head:
                self._head += view
            return
        self.layout = layout
        self._on_layout(layout)
        if self.whole is None:
            self._take(0, head)  # what arrived so far, now that we know where the data is
        else:
            self.whole[: len(head)] = head
        self._head = bytearray()

    def _unparsable(self, head: memoryview, error: RecordFormatError) -> None:
        if self.max_whole is not None and self.place.length > self.max_whole:
            self.fault = RecordFault(f"the record's header is not a torch.save tensor archive ({error})")
            return
        if not self._head:  # the header was parsed from the piece itself
            self._head += head
        self.hold_whole()

    def _take(self, start: int, view: memoryview) -> None:
        layout = self.layout
        assert layout is not None
        end = start + len(view)
        lo, hi = max(start, layout.data_start), min(end, layout.data_end)
        if lo < hi:
            piece = view[lo - start : hi - start]
            if self._dest is not None:
                self._dest[lo - layout.data_start : hi - layout.data_start] = piece
            if self.checksum:
                self.crc = crc32(piece, self.crc)
        if end > layout.data_end and len(self._tail) < CRC_TAIL:
            at = max(start, layout.data_end)
            self._tail += view[at - start : at - start + CRC_TAIL - len(self._tail)]

    # --- judging -----------------------------------------------------------------------------

    def check_streamed(self) -> RecordFault | None:
        """After the last byte of a streamed record: what is wrong with it, if anything."""
        layout = self.layout
        assert layout is not None
        if layout.data_end > self.place.length:
            return RecordFault(
                f"the record is {self.place.length} bytes but its tensor data ends at byte {layout.data_end}"
            )
        if not self.checksum or not layout.spec.nbytes:
            return None
        return self._compare(layout, self._tail, self.crc)

    def decode(self, data: memoryview) -> torch.Tensor | RecordFault:
        """The tensor a whole record holds (checked against its CRC-32), or what is wrong with it."""
        try:
            layout = parse_layout(data)
        except RecordFormatError:
            layout = None
        if (
            layout is not None
            and len(data) >= layout.data_end + CRC_TAIL
            and self.checksum
            and layout.spec.nbytes
        ):
            fault = self._compare(
                layout, data[layout.data_end :], crc32(data[layout.data_start : layout.data_end], 0)
            )
            if fault is not None:
                return fault
        import torch

        from dcp_fsspec.storage.format.tensor_records import tensor_from_record

        try:
            tensor = tensor_from_record(data, layout)
        except Exception as e:  # noqa: BLE001 - torch.load's errors vary; all mean "not a tensor"
            return RecordFault(f"cannot decode the tensor ({type(e).__name__}: {e})")
        if not isinstance(tensor, torch.Tensor):
            return RecordFault(f"the record holds a {type(tensor).__name__}, not a tensor")
        return tensor

    def _compare(
        self, layout: RecordLayout, tail: bytes | bytearray | memoryview, actual: int
    ) -> RecordFault | None:
        if layout.crc_in_header is not None:
            stored = layout.crc_in_header
        else:
            try:
                stored = descriptor_crc(tail)
            except RecordFormatError:
                return RecordFault("no zip data descriptor (with the CRC-32) after the tensor data")
        if stored == 0:  # written without a checksum
            return None
        self.compared = True
        if stored != actual:
            return RecordFault("checksum mismatch", ChecksumMismatchError, stored, actual)
        return None


Placed = TypeVar("Placed", bound=RecordPlace)


def feed_records(
    records: Sequence[Placed],
    fetched: Iterable[tuple[Span, bytes | bytearray]],
    start: Callable[[int], RecordDecoder],
) -> None:
    """Hand each fetched span's bytes to the decoders of the records it overlaps, in order.

    Args:
        records: sorted by ``(path, offset)``.
        fetched: ``(span, data)`` in the same order (:func:`~dcp_fsspec.storage.read.fetch.fetch_in_order` over
            :func:`~dcp_fsspec.storage.read.fetch.plan_spans` of the records).
        start: the decoder of ``records[i]``, called on its first bytes. A record whose bytes
            did not all arrive (a span came back short) is left with fewer bytes received.
    """
    cursor = 0
    active: dict[int, RecordDecoder] = {}
    for span, data in fetched:
        view = memoryview(data)[: span.size]
        got_end = span.start + len(view)
        # Records before this span are finished; walk those that overlap it.
        while cursor < len(records) and (records[cursor].path, records[cursor].end) <= (
            span.path,
            span.start,
        ):
            cursor += 1
        i = cursor
        while i < len(records) and records[i].path == span.path and records[i].offset < span.end:
            rec = records[i]
            lo, hi = max(rec.offset, span.start), min(rec.end, got_end)
            decoder = active.get(i)
            if decoder is None and lo == rec.offset < hi:
                decoder = active[i] = start(i)
            # After a span that came back short, a record has a hole: it stays incomplete.
            if decoder is not None and lo < hi and lo == rec.offset + decoder.received:
                decoder.feed(view[lo - span.start : hi - span.start])
                if decoder.done:
                    del active[i]
            i += 1
