"""torch's per-tensor records: encoding them without copying, decoding them straight into tensors.

torch's ``FileSystemWriter`` stores each tensor as one ``torch.save`` archive (an uncompressed
zip: ``data.pkl``, a few small entries, the raw storage bytes as ``data/0``, then the central
directory) at an offset in a ``.distcp`` file. We keep that format exactly, so torch's readers
load what we write, but avoid its two costs:

* Encoding: ``torch.save`` copies every tensor into the archive, at a fixed cost per tensor. We
  write the archive's small header and trailer ourselves (:mod:`archive`, checked against
  torch.save once per dtype) and stream the tensor's own memory in between, with the CRC-32 of
  ``data/0`` where torch's own writer puts it, so the record carries a checksum torch defines.
  Where :mod:`archive` does not apply (empty tensors, > 4 GiB, conjugate bits, a torch whose
  archive it does not reproduce), ``torch.save`` runs under ``torch.serialization.skip_data()``
  into a sink that keeps only the header and trailer, once per dtype and shape.
* Decoding: torch's reader runs ``torch.load`` per record. We parse the zip's local headers and
  ``data.pkl`` (:mod:`~dcp_fsspec.storage.format.record_layout`, with :mod:`~dcp_fsspec.storage.format.tensor_spec`'s restricted unpickler), learn
  where the storage bytes sit, and copy them straight into the target tensor, verifying the CRC-32 on the way.
  Anything unusual falls back to ``torch.load``.
"""

from __future__ import annotations

import ctypes
import io
import struct
import sys
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
from torch.serialization import skip_data

from dcp_fsspec.errors import RecordFormatError
from dcp_fsspec.storage.format.archive import ArchiveFormat, can_write, pickle_tensor
from dcp_fsspec.storage.format.crc import crc32
from dcp_fsspec.storage.format.record_layout import RecordLayout, parse_layout

_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL_HEADER = b"PK\x01\x02"
_EOCD = b"PK\x05\x06"
_ZIP64_EOCD_LOCATOR = b"PK\x06\x07"


# A ctypes byte array as long as memory can be: views of tensor memory are slices of one
# placed at the tensor's address. ``c_ubyte * nbytes`` per tensor would create, and cache
# forever, one ctypes type per distinct size.
_ANY_BYTES = ctypes.c_ubyte * sys.maxsize


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy, writable byte view of a contiguous CPU tensor's memory.

    Built with ctypes rather than ``tensor.numpy()``: torch does not install numpy, and this is
    on every save's and load's path. The view keeps the tensor alive.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(
            f"tensor_bytes needs a contiguous CPU tensor, got {tensor.device} strides {tensor.stride()}"
        )
    array = _ANY_BYTES.from_address(tensor.data_ptr())
    setattr(array, "_owner", tensor)  # the memory lives as long as the view
    return memoryview(array)[:nbytes].cast("B")


def storage_ready(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a record will hold it: detached, on CPU, contiguous, owning exactly its bytes.

    A view into a larger storage would otherwise save the whole storage (torch's writer clones in
    that case too).
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if (
        not t.is_contiguous()
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        t = t.contiguous() if not t.is_contiguous() else t.clone()
    return t


class _GapSink(io.RawIOBase):
    """A seekable write-only stream that keeps what is written and only notes what is skipped."""

    def __init__(self) -> None:
        self.pos = 0
        self.end = 0
        self.writes: list[tuple[int, bytes]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.writes.append((self.pos, data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.end}[whence]
        self.pos = base + offset
        return self.pos


@dataclass
class EncodedRecord:
    """One tensor record as three buffers whose concatenation is a ``torch.save`` archive."""

    header: bytes
    data: memoryview
    trailer: bytes
    crc32: int
    tensor: torch.Tensor  # keeps ``data``'s memory alive

    @property
    def nbytes(self) -> int:
        return len(self.header) + len(self.data) + len(self.trailer)

    def buffers(self) -> list[memoryview | bytes]:
        return [self.header, self.data, self.trailer] if len(self.data) else [self.header, self.trailer]


@dataclass
class FramedTensor:
    """A tensor record before its CRC is known: the header, the tensor's bytes, and the trailer
    as a function of their CRC-32 (the CRC sits after the data, in the zip's data descriptor).

    A writer that checksums the data on its way out anyway (S3's request checksum) writes the
    header, then the data, and builds the trailer from the CRC that pass gave: one pass.
    """

    header: bytes
    data: memoryview
    tensor: torch.Tensor  # keeps ``data``'s memory alive
    _trailer: bytes
    _crc_offsets: tuple[int, ...]  # where in the trailer the CRC goes; () for no data

    def trailer(self, crc: int) -> bytes:
        """The bytes after the data, holding ``crc`` (ignored for a record without data)."""
        if not self._crc_offsets:
            return self._trailer
        trailer = bytearray(self._trailer)
        for offset in self._crc_offsets:
            struct.pack_into("<I", trailer, offset, crc)
        return bytes(trailer)


@dataclass(frozen=True)
class _Template:
    """The archive around a tensor's bytes, for one dtype and shape: all but two CRC fields."""

    header: bytes
    trailer: bytes
    crc_offsets: tuple[int, ...]  # where in ``trailer`` the CRC-32 of the data goes


# Archives depend only on dtype and shape (and a serialization id torch only logs), so where
# torch.save must build them, each is built once per dtype and shape.
_TEMPLATES: dict[tuple[torch.dtype, tuple[int, ...]], _Template] = {}
_MAX_TEMPLATES = 4096


# dtype → how to write its archive directly, or None where torch.save must (see :mod:`archive`).
_FORMATS: dict[torch.dtype, ArchiveFormat | None] = {}


def frame_tensor(tensor: torch.Tensor) -> FramedTensor:
    """Frame ``tensor`` as torch's per-tensor record without copying or reading its data."""
    t = storage_ready(tensor)
    data = tensor_bytes(t)
    if len(data) and can_write(t):
        if t.dtype not in _FORMATS:
            _FORMATS[t.dtype] = ArchiveFormat.learn(t.dtype)
        fmt = _FORMATS[t.dtype]
        if fmt is not None:
            # The archive's local headers carry no CRC (it is in the data descriptor), so the
            # header is the same whatever the CRC: frame once with 0, then find where it goes.
            head, tail = fmt.frame(pickle_tensor(t), len(data), 0)
            return FramedTensor(
                head, data, t, tail, _data_crc_offsets(bytearray(tail), data_end=len(head) + len(data))
            )
    key = (t.dtype, tuple(t.shape))
    template = _TEMPLATES.get(key)
    if template is None:
        template = _build_template(t, len(data))
        if len(_TEMPLATES) >= _MAX_TEMPLATES:
            _TEMPLATES.clear()
        _TEMPLATES[key] = template
    return FramedTensor(template.header, data, t, template.trailer, template.crc_offsets)


def encode_framed(framed: FramedTensor, *, checksum: bool = True) -> EncodedRecord:
    """The record of a framed tensor (:func:`frame_tensor`), its CRC-32 computed here.

    ``checksum``: compute the data's CRC-32 for the record (else the record stores 0, which
    torch's readers do not check and ours skip).
    """
    crc = crc32(framed.data, 0) if checksum and len(framed.data) else 0
    return EncodedRecord(framed.header, framed.data, framed.trailer(crc), crc, framed.tensor)


def _build_template(t: torch.Tensor, nbytes: int) -> _Template:
    sink = _GapSink()
    with skip_data():
        torch.save(t, cast(IO[bytes], sink))
    # torch wrote everything but the storage bytes, leaving one hole of exactly their size.
    head, tail = bytearray(), bytearray()
    for pos, chunk in sorted(sink.writes, key=lambda w: w[0]):
        if pos == len(head) and not tail:
            head += chunk
        elif pos == len(head) + nbytes + len(tail):
            tail += chunk
        else:
            raise RecordFormatError("torch.save(skip_data) left an unexpected layout")
    if len(head) + nbytes + len(tail) != sink.end:
        raise RecordFormatError("torch.save(skip_data) left an unexpected layout")
    if nbytes == 0:
        return _Template(bytes(head), bytes(tail), ())
    return _Template(bytes(head), bytes(tail), _data_crc_offsets(tail, data_end=len(head) + nbytes))


def _data_crc_offsets(trailer: bytearray, *, data_end: int) -> tuple[int, int]:
    """Where ``data/0``'s CRC-32 sits in its data descriptor and its central-directory entry.

    ``trailer`` starts right after the storage bytes, at absolute offset ``data_end``.
    """
    if trailer[:4] != _DESCRIPTOR:
        raise RecordFormatError("no data descriptor after the tensor data")
    eocd = trailer.rfind(_EOCD)
    if eocd < 0:
        raise RecordFormatError("no end of central directory")
    (cd_offset,) = struct.unpack_from("<I", trailer, eocd + 16)
    if cd_offset == 0xFFFFFFFF:
        locator = trailer.rfind(_ZIP64_EOCD_LOCATOR, 0, eocd)
        (zip64_eocd,) = struct.unpack_from("<Q", trailer, locator + 8)
        (cd_offset,) = struct.unpack_from("<Q", trailer, zip64_eocd - data_end + 48)
    pos = cd_offset - data_end
    while trailer[pos : pos + 4] == _CENTRAL_HEADER:
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", trailer, pos + 28)
        name = bytes(trailer[pos + 46 : pos + 46 + name_len])
        if name.endswith(b"/data/0"):
            return (4, pos + 16)
        pos += 46 + name_len + extra_len + comment_len
    raise RecordFormatError("no central directory entry for data/0")


# --- decoding (the header is parsed in :mod:`~dcp_fsspec.storage.format.record_layout`, without torch) ------------------


def tensor_from_record(record: bytes | memoryview, layout: RecordLayout | None = None) -> torch.Tensor:
    """Decode a whole record to a tensor that shares ``record``'s memory when it can."""
    view = memoryview(record)
    try:
        layout = layout or parse_layout(view)
    except RecordFormatError:
        layout = None
    if layout is None or len(view) < layout.data_end:
        return torch.load(io.BytesIO(bytes(view)), map_location="cpu", weights_only=True)
    spec = layout.spec
    if spec.storage_numel == 0:
        flat = torch.empty(0, dtype=spec.torch_dtype)
    else:
        raw = view[layout.data_start : layout.data_end]
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(spec.torch_dtype)
    return flat.as_strided(spec.size, spec.stride, spec.storage_offset)
