"""Where a tensor record's bytes are: its zip headers and ``data.pkl`` parsed, without torch.

A record is one ``torch.save`` archive (see :mod:`~dcp_fsspec.storage.format.tensor_records`). :func:`parse_layout` reads its
leading local headers and ``data.pkl`` (:mod:`~dcp_fsspec.storage.format.tensor_spec`) and says where the tensor's bytes
start, how many there are, and where the CRC-32 of them is stored. Loads and ``verify`` share it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from dcp_fsspec.errors import RecordFormatError
from dcp_fsspec.storage.format.tensor_spec import TensorSpec, parse_pickle

_LOCAL_HEADER = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_LOCAL_HEADER_SIZE = 30
_FLAG_DESCRIPTOR = 0x08


@dataclass(frozen=True)
class RecordLayout:
    """Where a record's tensor bytes are, relative to the record's first byte."""

    spec: TensorSpec
    data_start: int
    # Where the CRC-32 of data/0 sits: in the local header (flag bit 3 clear), or in the data
    # descriptor right after the data (torch's own writer).
    crc_in_header: int | None

    @property
    def data_end(self) -> int:
        return self.data_start + self.spec.nbytes


# Records of one dtype and shape written by one writer share their header bytes exactly, so a
# checkpoint of many small tensors parses each distinct header once: header length → bytes → layout.
# Bounded for a crafted checkpoint: few lengths (each is a lookup per record), short headers (a
# torch.save header is under 1 KiB), and a byte budget for them all.
_KNOWN_HEADERS: dict[int, dict[bytes, RecordLayout]] = {}
_MAX_HEADER_LENGTHS = 64
_MAX_CACHED_HEADER = 4096
_MAX_KNOWN_HEADER_BYTES = 4 << 20


def parse_layout(head: bytes | memoryview) -> RecordLayout | None:
    """Parse a record's leading bytes; ``None`` if ``head`` is too short to say yet.

    Raises:
        RecordFormatError: the bytes are not a torch.save record we can decode directly.
    """
    buf = memoryview(head)
    for length, known in _KNOWN_HEADERS.items():
        if len(buf) >= length:
            layout = known.get(bytes(buf[:length]))
            if layout is not None:
                return layout
    layout = _parse_layout(buf)
    # (A CRC in the local header differs per record; such headers are not worth keeping.)
    if layout is not None and layout.crc_in_header is None and layout.data_start <= _MAX_CACHED_HEADER:
        _remember_header(bytes(buf[: layout.data_start]), layout)
    return layout


def _remember_header(header: bytes, layout: RecordLayout) -> None:
    cached = sum(length * len(known) for length, known in _KNOWN_HEADERS.items())
    full = cached + len(header) > _MAX_KNOWN_HEADER_BYTES
    if full or (len(header) not in _KNOWN_HEADERS and len(_KNOWN_HEADERS) >= _MAX_HEADER_LENGTHS):
        _KNOWN_HEADERS.clear()
    _KNOWN_HEADERS.setdefault(len(header), {})[header] = layout


def _parse_layout(buf: memoryview) -> RecordLayout | None:
    pos = 0
    spec: TensorSpec | None = None
    after_pickle = -1  # where the entries after the (one) data.pkl start, while caching them is sound
    while True:
        if pos == after_pickle and (known := _known_entries(buf, pos)) is not None:
            assert spec is not None
            return RecordLayout(spec, known, None)
        entry = _local_header(buf, pos)
        if entry is None:
            return None
        name, start, has_descriptor, crc, csize = entry
        if name.endswith(b"/data/0"):
            if spec is None:
                raise RecordFormatError("data/0 before data.pkl")
            if has_descriptor and after_pickle >= 0:
                _remember_entries(buf, after_pickle, start)
            return RecordLayout(spec, start, None if has_descriptor else crc)
        end: int | None
        if name.endswith(b"/data.pkl"):
            parsed = parse_pickle(buf[start:])
            if parsed is None:
                return None
            spec, length = parsed
            end = start + length
        elif not has_descriptor:
            end = start + csize
        else:
            end = _find_descriptor(buf, start)
        if end is not None and has_descriptor:
            end = _skip_descriptor(buf, end)
        if end is None:
            return None
        if name.endswith(b"/data.pkl"):
            # A second data.pkl would change the spec: the entries after the first are not cached.
            after_pickle = end if after_pickle == -1 else -2
        pos = end


def _local_header(buf: memoryview, pos: int) -> tuple[bytes, int, bool, int, int] | None:
    """The zip local header at ``pos``: its entry's name, where its data starts, whether a
    data descriptor follows the data, its CRC-32 and size fields; ``None`` if ``buf`` ends first."""
    if len(buf) < pos + _LOCAL_HEADER_SIZE:
        return None
    if bytes(buf[pos : pos + 4]) != _LOCAL_HEADER:
        raise RecordFormatError(f"no zip entry at byte {pos} of the record")
    flags, method, crc, csize, _usize, name_len, extra_len = struct.unpack_from("<HHxxxxIIIHH", buf, pos + 6)
    if method != 0:
        raise RecordFormatError("compressed zip entry")
    start = pos + _LOCAL_HEADER_SIZE + name_len + extra_len
    if len(buf) < start:
        return None
    name = bytes(buf[pos + _LOCAL_HEADER_SIZE : pos + _LOCAL_HEADER_SIZE + name_len])
    return name, start, bool(flags & _FLAG_DESCRIPTOR), crc, csize


# The zip entries between data.pkl and data/0 (torch's .format_version, byteorder, …) are the
# same bytes in every record of one writer, padding included. Their walk is most of a header's
# parse once data.pkl differs per shape, so it is done once per distinct run of bytes: the first
# 64 bytes → (all of them, up to data/0's data). Only runs ending in a data/0 whose CRC-32 is in
# its data descriptor are kept (a CRC in the local header differs per record), and only short
# ones, few of them: a crafted checkpoint cannot make the cache large.
_KNOWN_ENTRIES: dict[bytes, bytes] = {}
_ENTRIES_KEY = 64
_MAX_ENTRIES_LENGTH = 4096
_MAX_KNOWN_ENTRIES = 256


def _known_entries(buf: memoryview, pos: int) -> int | None:
    """Where data/0's bytes start, if ``buf[pos:]`` begins with a run of entries seen before."""
    entries = _KNOWN_ENTRIES.get(bytes(buf[pos : pos + _ENTRIES_KEY]))
    if entries is None or bytes(buf[pos : pos + len(entries)]) != entries:
        return None
    return pos + len(entries)


def _remember_entries(buf: memoryview, pos: int, data_start: int) -> None:
    if not _ENTRIES_KEY <= data_start - pos <= _MAX_ENTRIES_LENGTH:
        return
    if len(_KNOWN_ENTRIES) >= _MAX_KNOWN_ENTRIES:
        _KNOWN_ENTRIES.clear()
    _KNOWN_ENTRIES[bytes(buf[pos : pos + _ENTRIES_KEY])] = bytes(buf[pos:data_start])


def _find_descriptor(buf: memoryview, start: int) -> int | None:
    """Where the data descriptor of a small entry starting at ``start`` is (its size is only there)."""
    window = bytes(buf[start : start + 4096])
    at = 0
    while (hit := window.find(_DESCRIPTOR, at)) >= 0:
        if len(window) < hit + 16:
            return None
        if struct.unpack_from("<I", window, hit + 8)[0] == hit:
            return start + hit
        at = hit + 1
    if len(window) < 4096:
        return None
    raise RecordFormatError("small zip entry without a data descriptor")


def _skip_descriptor(buf: memoryview, pos: int) -> int | None:
    """The end of the data descriptor at ``pos`` (16 bytes, or 24 with zip64 sizes)."""
    if len(buf) < pos + 20:
        return None
    if bytes(buf[pos : pos + 4]) != _DESCRIPTOR:
        raise RecordFormatError("missing zip data descriptor")
    return pos + 16 if bytes(buf[pos + 16 : pos + 20]) == _LOCAL_HEADER else pos + 24


def descriptor_crc(record_tail: bytes | bytearray | memoryview) -> int:
    """The CRC-32 in the data descriptor that starts ``record_tail`` (right after data/0)."""
    if bytes(record_tail[:4]) != _DESCRIPTOR:
        raise RecordFormatError("no data descriptor after the tensor data")
    return int(struct.unpack_from("<I", record_tail, 4)[0])
