"""One decoder for loads and verification: the same damage is rejected the same way by both.

The storage-level :func:`verify_checkpoint` checks one DCP checkpoint folder and reports each
problem with the file, the tensor and the error class a load raises; a load of the same bytes
must raise exactly that class.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.distributed.checkpoint._extension import ZStandard

from dcp_fsspec import Checkpointer, ChecksumMismatchError, CorruptCheckpointError, WriterSettings
from dcp_fsspec.storage.checkpoint_files import integrity
from dcp_fsspec.storage.checkpoint_files.integrity import verify_checkpoint
from dcp_fsspec.storage.format.record_layout import parse_layout
from tests.conftest import Backend
from tests.helpers import flip_a_byte_of_each_data_file_once_written, load, raises_through_dcp, save
from tests.test_verify import _flip_tensor_byte, _record

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {"weight": torch.randn(64, 32, generator=gen), "bias": torch.randn(32, generator=gen)}


def _damage_record(backend: Backend, fqn: str, at: Callable[[int, int, int], int]) -> None:
    """Flip a byte of ``fqn``'s record at ``at(offset, data_start, data_end)`` (absolute)."""
    path, offset, length = _record(backend, fqn)
    data = bytearray(backend.fs.cat_file(path))
    layout = parse_layout(bytes(data[offset : offset + length]))
    assert layout is not None
    data[at(offset, offset + layout.data_start, offset + layout.data_end)] ^= 0xFF
    backend.fs.pipe_file(path, bytes(data))


DAMAGE = {
    # A tensor byte: the CRC-32 no longer matches.
    "tensor_byte": (lambda off, start, end: (start + end) // 2, ChecksumMismatchError),
    # The data descriptor's signature, which holds the CRC-32 torch's writer stores.
    "descriptor": (lambda off, start, end: end, CorruptCheckpointError),
    # The zip header's signature: neither our parser nor torch.load can read the record.
    "zip_header": (lambda off, start, end: off, CorruptCheckpointError),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_load_and_a_verification_reject_the_same_damaged_record_with_the_same_error_class(
    memory_backend: Backend, damage: str
) -> None:
    where, error = DAMAGE[damage]
    save(_state(), memory_backend)
    _damage_record(memory_backend, "weight", where)
    with raises_through_dcp(CorruptCheckpointError) as raised:
        load({k: torch.zeros_like(v) for k, v in _state().items()}, memory_backend)
    assert type(raised.value) is error
    report = verify_checkpoint(memory_backend.url)
    assert [(p.item, p.error) for p in report.problems] == [("weight", error.__name__)]
    data_file = report.problems[0].url
    assert data_file.rsplit("/", 1)[-1] in str(raised.value) and "'weight'" in str(raised.value)


def test_the_storage_level_verification_of_a_flipped_byte_names_the_file_and_the_tensor(
    local_backend: Backend,
) -> None:
    save(_state(), local_backend)
    before, after = _flip_tensor_byte(local_backend, "bias")
    report = verify_checkpoint(local_backend.url)
    path, _, _ = _record(local_backend, "bias")
    assert report.kind == "checkpoint" and report.checkpoints == [local_backend.url]
    assert len(report.problems) == 1, report.problems
    problem = report.problems[0]
    assert (problem.url, problem.item, problem.error) == (path, "bias", "ChecksumMismatchError")
    assert (problem.stored_crc32, problem.actual_crc32) == (before, after)
    assert path in str(problem) and f"{before:#010x}" in str(problem)
    assert report.tensors_checked == 1


def test_the_storage_level_verification_reports_a_missing_metadata_rather_than_raising(
    memory_backend: Backend,
) -> None:
    report = verify_checkpoint(memory_backend.url)
    assert [(p.url, p.error) for p in report.problems] == [
        (memory_backend.sub(".metadata"), "CheckpointNotFoundError")
    ]


def test_a_file_that_shrinks_while_it_is_verified_reports_each_record_it_no_longer_holds(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(_state(), memory_backend)
    _, offset, _ = _record(memory_backend, "weight")
    lost = {fqn for fqn in _state() if _record(memory_backend, fqn)[1] >= offset}
    fetch = integrity.fetch_in_order

    def shrunk(fs: object, spans: list, **kwargs: object) -> Iterator[tuple[object, bytes]]:
        # The file now ends 100 bytes into "weight"'s record: later ranges come back short or empty.
        for span, data in fetch(fs, spans, **kwargs):
            yield span, data[: max(0, offset + 100 - span.start)]

    monkeypatch.setattr(integrity, "fetch_in_order", shrunk)
    report = verify_checkpoint(memory_backend.url, max_request_bytes=64)
    assert {p.item for p in report.problems} == lost
    assert all("the file ended after" in p.what for p in report.problems)


# --- transformed (compressed) records -------------------------------------------------------

zstandard = pytest.importorskip("zstandard")

# Torch's ZStandard writes no frame checksum: a flipped byte then surfaces as our CRC-32 mismatch;
# compression="zstd" (LeveledZStandard) writes one: zstd itself rejects the frame.
COMPRESSORS = {
    "compression_zstd": ({"compression": "zstd"}, CorruptCheckpointError),
    "torch_ZStandard": ({"_extensions": [ZStandard()]}, ChecksumMismatchError),
}


@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_the_verification_of_a_compressed_checkpoint_checks_every_tensor_record_against_its_crc(
    memory_backend: Backend, compressor: str
) -> None:
    save(_state(), memory_backend, **COMPRESSORS[compressor][0])
    report = verify_checkpoint(memory_backend.url)
    assert report.ok, report.problems
    assert (report.tensors_checked, report.unchecked) == (2, 0)


@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_a_flipped_byte_in_a_compressed_record_fails_the_verification_and_the_load_alike_naming_the_entry(
    memory_backend: Backend, compressor: str
) -> None:
    options, error = COMPRESSORS[compressor]
    save(_state(), memory_backend, **options)
    path, offset, length = _record(memory_backend, "weight")
    data = bytearray(memory_backend.fs.cat_file(path))
    data[offset + length // 2] ^= 0x01  # in the middle of randn's bytes: zstd stores them as literals
    memory_backend.fs.pipe_file(path, bytes(data))
    report = verify_checkpoint(memory_backend.url)
    assert [(p.url.endswith(path), p.item, p.error) for p in report.problems] == [
        (True, "weight", error.__name__)
    ]
    with raises_through_dcp(CorruptCheckpointError) as raised:
        load({k: torch.zeros_like(v) for k, v in _state().items()}, memory_backend)
    assert type(raised.value) is error and "'weight'" in str(raised.value)


def _streamed_bomb(size: int) -> bytes:
    """A zstd frame of ``size`` zero bytes that does not declare its size (as a stream writes it)."""
    packer = zstandard.ZstdCompressor(level=3).compressobj()
    zeros = bytes(8 * MiB)
    return b"".join(packer.compress(zeros) for _ in range(size // len(zeros))) + packer.flush()


BOMBS = {
    "declared_size": lambda size: zstandard.ZstdCompressor(level=3).compress(bytes(size)),
    "streamed": _streamed_bomb,
}
MiB = 1024 * 1024


def _plant_bomb(backend: Backend, bomb: str) -> str:
    """Save compressed, then put a zstd frame of 256 MiB of zeros where ``weight``'s 8 KiB go."""
    save(_state(), backend, compression="zstd")
    path, offset, length = _record(backend, "weight")
    frame = BOMBS[bomb](256 * MiB)
    assert len(frame) <= length  # zstd ignores what follows the frame: the rest stays as it was
    data = bytearray(backend.fs.cat_file(path))
    data[offset : offset + len(frame)] = frame
    backend.fs.pipe_file(path, bytes(data))
    return path


@contextmanager
def _peak_python_memory() -> Iterator[list[int]]:
    """The most memory Python's allocators held at once in the block (bytes objects included)."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


@pytest.mark.parametrize("bomb", BOMBS)
def test_a_zstd_bomb_fails_the_verification_without_expanding(memory_backend: Backend, bomb: str) -> None:
    path = _plant_bomb(memory_backend, bomb)
    with _peak_python_memory() as peak:
        report = verify_checkpoint(memory_backend.url)
    assert [(p.url.endswith(path), p.item, p.error) for p in report.problems] == [
        (True, "weight", "CorruptCheckpointError")
    ]
    assert peak[0] < 32 * MiB, peak


@pytest.mark.parametrize("bomb", BOMBS)
def test_a_zstd_bomb_fails_the_load_without_expanding(memory_backend: Backend, bomb: str) -> None:
    path = _plant_bomb(memory_backend, bomb)
    state = {k: torch.zeros_like(v) for k, v in _state().items()}
    with _peak_python_memory() as peak, raises_through_dcp(CorruptCheckpointError) as raised:
        load(state, memory_backend)
    assert type(raised.value) is CorruptCheckpointError
    assert path in str(raised.value) and "'weight'" in str(raised.value)
    assert peak[0] < 32 * MiB, peak


def test_verify_before_commit_refuses_a_compressed_iteration_whose_record_changed_once_written(
    local_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    with Checkpointer(
        local_backend.url, verify_before_commit=True, writer_settings=WriterSettings(compression="zstd")
    ) as ckpt:
        ckpt.save(1, trainer={"w": weights})
        flip_a_byte_of_each_data_file_once_written(monkeypatch)
        with pytest.raises(CorruptCheckpointError) as info:
            ckpt.save(2, trainer={"w": weights * 2})
        assert "iter_000000002" in str(info.value) and "'trainer" in str(info.value)
        assert ckpt.latest_checkpoint() == "iter_000000001"
