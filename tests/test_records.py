"""torch's per-tensor record format: what we encode is what torch.save writes, and we decode both."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
import torch

from dcp_fsspec.errors import RecordFormatError
from dcp_fsspec.storage.format import record_layout, tensor_records
from dcp_fsspec.storage.format.archive import ArchiveFormat
from dcp_fsspec.storage.format.record_layout import descriptor_crc, parse_layout
from dcp_fsspec.storage.format.tensor_records import (
    EncodedRecord,
    encode_framed,
    frame_tensor,
    storage_ready,
    tensor_bytes,
    tensor_from_record,
)
from dcp_fsspec.storage.format.tensor_spec import TensorSpec
from tests.helpers import differences_outside_the_serialization_id
from tests.states import DTYPES, random_tensor


def encode_tensor(tensor: torch.Tensor) -> EncodedRecord:
    """A tensor's whole record, as the writer encodes it where a transform follows."""
    return encode_framed(frame_tensor(tensor))


GEN = torch.Generator().manual_seed(3)
CASES = {
    "matrix": torch.randn(10, 10, generator=GEN),
    "transposed": torch.randn(3, 4, generator=GEN).t(),
    "slice_of_larger_storage": torch.randn(100, generator=GEN)[10:20],
    "empty": torch.zeros(0, 3),
    "scalar": torch.tensor(3.5),
    **{str(d): random_tensor((4, 3), d, GEN) for d in DTYPES},
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", CASES)
def test_encoded_record_is_a_torch_save_archive_with_the_data_crc(name: str) -> None:
    tensor = CASES[name]
    record = encode_tensor(tensor)
    blob = b"".join(bytes(b) for b in record.buffers())
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
    assert torch.equal(_bits(loaded), _bits(tensor))
    layout = parse_layout(blob)
    assert layout is not None
    if tensor.numel():
        assert descriptor_crc(blob[layout.data_end :]) == zlib.crc32(
            bytes(tensor_bytes(storage_ready(tensor)))
        )


@pytest.mark.parametrize("name", CASES)
def test_records_written_by_torch_save_decode_without_torch_load(name: str) -> None:
    tensor = CASES[name]
    buffer = io.BytesIO()
    torch.save(storage_ready(tensor), buffer)
    blob = buffer.getvalue()
    layout = parse_layout(blob)
    assert layout is not None
    decoded = tensor_from_record(blob, layout)
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert torch.equal(_bits(decoded), _bits(tensor))


def test_parsing_a_prefix_asks_for_more_bytes_until_the_data_starts() -> None:
    blob = b"".join(bytes(b) for b in encode_tensor(torch.randn(64)).buffers())
    full = parse_layout(blob)
    assert full is not None
    for cut in range(0, full.data_start):
        assert parse_layout(blob[:cut]) is None
    assert parse_layout(blob[: full.data_start]) == full


def test_bytes_that_are_not_a_record_are_refused() -> None:
    with pytest.raises(RecordFormatError):
        parse_layout(b"this is not a zip archive at all, not even close")


def test_encoding_does_not_copy_a_contiguous_tensor() -> None:
    tensor = torch.randn(1024)
    record = encode_tensor(tensor)
    assert torch.frombuffer(record.data, dtype=torch.float32).data_ptr() == tensor.data_ptr()


def _torch_save(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


SHAPES = [(), (1,), (7,), (300, 2), (2, 3, 4, 5), (70_000,)]


@pytest.mark.parametrize("direct", [True, False], ids=["archive-written-here", "torch-save-template"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_records_are_torch_save_byte_for_byte_but_its_serialization_id(
    dtype: torch.dtype, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not direct:
        monkeypatch.setitem(tensor_records._FORMATS, dtype, None)
    for shape in SHAPES:
        tensor = random_tensor(shape, dtype, GEN)
        ours = b"".join(bytes(b) for b in encode_tensor(tensor).buffers())
        assert differences_outside_the_serialization_id(ours, _torch_save(tensor)) == [], shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_this_torch_archive_is_written_directly_for_every_dtype(dtype: torch.dtype) -> None:
    # If torch changes its archive, records fall back to torch.save (correct, ~10x slower per
    # small tensor); this test is what notices.
    assert ArchiveFormat.learn(dtype) is not None


def test_an_archive_this_module_cannot_reproduce_is_left_to_torch_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_save = torch.save

    def save_differently(obj: object, f: io.BytesIO, **kwargs: object) -> None:
        real_save(obj, f, **kwargs)
        f.seek(0)
        data = f.read()
        f.seek(0)
        f.truncate()
        f.write(data[:-1] + b"!")  # any difference at all

    monkeypatch.setattr(torch, "save", save_differently)
    assert ArchiveFormat.learn(torch.float32) is None


@pytest.mark.parametrize("size", [(), (0,), (3, 0, 2), (0, 4), (2, 1, 5), (1, 0), (7,), (4, 3, 2, 1)])
def test_a_spec_is_dense_exactly_when_its_strides_are_the_ones_torch_gives_a_new_tensor(
    size: tuple[int, ...],
) -> None:
    t = torch.empty(size)
    numel = t.numel()
    dense = TensorSpec(torch.float32, numel, 0, size, tuple(t.stride()))
    assert dense.is_dense
    if len(size) >= 2:  # the same shape, transposed strides: not row-major (unless a dimension is 1)
        transposed = tuple(t.transpose(0, 1).contiguous().transpose(0, 1).stride())
        spec = TensorSpec(torch.float32, numel, 0, size, transposed)
        assert spec.is_dense == (transposed == tuple(t.stride()))
    assert not TensorSpec(torch.float32, numel + 1, 0, size, tuple(t.stride())).is_dense
    assert not TensorSpec(torch.float32, numel, 1, size, tuple(t.stride())).is_dense


def test_a_spec_counts_its_bytes_by_the_dtypes_element_size() -> None:
    for dtype in DTYPES:
        spec = TensorSpec(dtype, 10, 0, (10,), (1,))
        assert spec.nbytes == 10 * torch.empty((), dtype=dtype).element_size(), dtype


def _entries_after_the_pickle(blob: bytes) -> tuple[int, int]:
    """Where the zip entries between data.pkl and data/0 start and end in ``blob``."""
    layout = parse_layout(blob)
    assert layout is not None
    return blob.index(b"PK\x07\x08") + 16, layout.data_start


def test_a_damaged_entry_after_the_pickle_is_refused_though_a_record_before_began_the_same() -> None:
    first = b"".join(bytes(b) for b in encode_tensor(torch.randn(300)).buffers())
    later = bytearray(b"".join(bytes(b) for b in encode_tensor(torch.randn(301)).buffers()))
    start, data_start = _entries_after_the_pickle(first)
    later_start, _ = _entries_after_the_pickle(bytes(later))
    # Different shapes, so different pickles; the entries after them are the same bytes.
    assert first[start:data_start] == later[later_start : later_start + data_start - start]
    assert parse_layout(first) is not None
    # The last of them (data/0's local header), damaged well past where they begin.
    damaged_at = later.rindex(b"PK\x03\x04", 0, later_start + data_start - start)
    assert damaged_at - later_start > 64
    later[damaged_at + 2] ^= 0xFF
    with pytest.raises(RecordFormatError, match="no zip entry"):
        parse_layout(bytes(later))


def _renamed(record: bytes, name: bytes) -> bytes:
    """``record`` with its first zip entry (data.pkl) under another name: a longer header."""
    name_length = struct.unpack_from("<H", record, 26)[0]
    head = bytearray(record[:30])
    struct.pack_into("<H", head, 26, len(name))
    return bytes(head) + name + record[30 + name_length :]


def test_headers_a_crafted_checkpoint_varies_cannot_grow_the_cache_of_parsed_headers() -> None:
    record = b"".join(bytes(b) for b in encode_tensor(torch.randn(3)).buffers())
    long_names = [b"x" * (60_000 + i) + b"/data.pkl" for i in range(200)]
    many_lengths = [b"y" * i + b"/data.pkl" for i in range(1, 500)]
    for name in long_names + many_lengths:
        assert parse_layout(_renamed(record, name)) is not None
    cached = record_layout._KNOWN_HEADERS
    assert sum(length * len(headers) for length, headers in cached.items()) <= 4 << 20
    assert len(cached) <= 64  # each length is a lookup on every record parsed
