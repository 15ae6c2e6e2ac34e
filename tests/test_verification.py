"""One decoder for loads and verification: the same damage is rejected the same way by both.

The storage-level :func:`verify_checkpoint` checks one DCP checkpoint folder and reports each
problem with the file, the tensor and the error class a load raises; a load of the same bytes
must raise exactly that class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from dcp_fsspec import ChecksumMismatchError, CorruptCheckpointError
from dcp_fsspec.storage import verification
from dcp_fsspec.storage.records import parse_layout
from dcp_fsspec.storage.verification import verify_checkpoint
from tests.conftest import Backend
from tests.helpers import load, raises_through_dcp, save
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


def test_the_storage_level_verification_reports_a_missing_metadata_rather_than_raising(memory_backend: Backend) -> None:
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
    fetch = verification.fetch_in_order

    def shrunk(fs: object, spans: list, **kwargs: object) -> Iterator[tuple[object, bytes]]:
        # The file now ends 100 bytes into "weight"'s record: later ranges come back short or empty.
        for span, data in fetch(fs, spans, **kwargs):
            yield span, data[: max(0, offset + 100 - span.start)]

    monkeypatch.setattr(verification, "fetch_in_order", shrunk)
    report = verify_checkpoint(memory_backend.url, max_request_bytes=64)
    assert {p.item for p in report.problems} == lost
    assert all("the file ended after" in p.what for p in report.problems)
