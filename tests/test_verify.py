"""``verify``: a whole checkpoint checked on storage — every file, every item, every CRC-32.

Damage is made the way storage makes it: bytes flipped, files cut short or lost, a ``.metadata``
garbled, a key's ``.metadata`` gone after its iteration was committed. Each problem must name
the file and the item, and a checksum mismatch both CRC-32s.
"""

from __future__ import annotations

import pickle
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_fsspec import Checkpointer, CheckpointNotFoundError, VerifyReport, verify
from dcp_fsspec.storage.format.record_layout import parse_layout
from tests.ckpt_helpers import Training
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.helpers import save
from tests.test_storage_distributed import _save_sharded_rows

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(300, 200, generator=gen),
        "bias": torch.randn(200, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(1000),
        "empty": torch.empty(0, 4),
        "step": 7,
    }


def _metadata(backend: Backend, url: str | None = None) -> Metadata:
    fs = backend.fs
    return pickle.loads(fs.cat_file(fs._strip_protocol((url or backend.url) + "/.metadata")))


def _record(backend: Backend, fqn: str, url: str | None = None) -> tuple[str, int, int]:
    """(data file path, offset, length) of ``fqn``'s record."""
    base = url or backend.url
    for index, info in _metadata(backend, base).storage_data.items():
        if index.fqn == fqn:
            return backend.fs._strip_protocol(f"{base}/{info.relative_path}"), info.offset, info.length
    raise KeyError(fqn)


def _flip_tensor_byte(backend: Backend, fqn: str, url: str | None = None) -> tuple[int, int]:
    """Flip one bit in ``fqn``'s tensor bytes; return (CRC-32 before, CRC-32 after) of those bytes."""
    path, offset, length = _record(backend, fqn, url)
    fs = backend.fs
    data = bytearray(fs.cat_file(path))
    layout = parse_layout(bytes(data[offset : offset + length]))
    assert layout is not None
    start, end = offset + layout.data_start, offset + layout.data_end
    before = zlib.crc32(data[start:end])
    data[start + (end - start) // 2] ^= 0x10
    fs.pipe_file(path, bytes(data))
    return before, zlib.crc32(data[start:end])


def _assert_only_problem_names(report: VerifyReport, url: str, item: str | None) -> None:
    assert not report.ok and len(report.problems) == 1, report.problems
    problem = report.problems[0]
    assert problem.url == url and problem.item == item, problem
    assert url in str(problem)


def test_a_sound_checkpoint_verifies_with_every_tensor_checksum_compared(backend: Backend) -> None:
    save(_state(), backend)
    report = verify(backend.url, backend.storage_options)
    assert report.ok, report.problems
    assert report.kind == "checkpoint" and report.checkpoints == [backend.url]
    # Four tensors; the empty one has no bytes to checksum, the int is a pickled object.
    assert (report.items, report.tensors_checked, report.unchecked) == (5, 3, 2)


def test_a_flipped_bit_is_reported_with_the_file_the_item_and_both_checksums(memory_backend: Backend) -> None:
    save(_state(), memory_backend)
    before, after = _flip_tensor_byte(memory_backend, "weight")
    report = verify(memory_backend.url)
    path, _, _ = _record(memory_backend, "weight")
    _assert_only_problem_names(report, memory_backend.sub(path.rsplit("/", 1)[-1]), "weight")
    problem = report.problems[0]
    assert (problem.stored_crc32, problem.actual_crc32) == (before, after)
    assert f"{before:#010x}" in str(problem) and f"{after:#010x}" in str(problem)
    assert report.tensors_checked == 2


def test_records_read_in_tiny_pieces_are_still_checked_whole(memory_backend: Backend) -> None:
    # Every header and every tensor is split across many ranged reads and a small window.
    save(_state(), memory_backend)
    assert verify(memory_backend.url, max_request_bytes=100, window_bytes=1000).tensors_checked == 3
    _flip_tensor_byte(memory_backend, "ids")
    report = verify(memory_backend.url, max_request_bytes=100, window_bytes=1000)
    assert [p.item for p in report.problems] == ["ids"] and report.problems[0].stored_crc32 is not None


def test_a_truncated_data_file_reports_the_items_that_no_longer_fit(local_backend: Backend) -> None:
    save(_state(), local_backend)
    path, offset, _ = _record(local_backend, "ids")
    with open(path, "r+b") as f:
        f.truncate(offset + 10)
    report = verify(local_backend.url)
    lost = {p.item for p in report.problems}
    assert "ids" in lost and all(p.url == path and "too short" in p.what for p in report.problems)


def test_a_missing_data_file_is_reported_with_the_items_it_held(memory_backend: Backend) -> None:
    save(_state(), memory_backend)
    path, _, _ = _record(memory_backend, "weight")
    memory_backend.fs.rm_file(path)
    report = verify(memory_backend.url)
    _assert_only_problem_names(report, memory_backend.sub(path.rsplit("/", 1)[-1]), None)
    assert "does not exist" in report.problems[0].what and "weight" in report.problems[0].what


def test_garbled_metadata_is_reported_rather_than_raised(memory_backend: Backend) -> None:
    save(_state(), memory_backend)
    path = memory_backend.fs._strip_protocol(memory_backend.url + "/.metadata")
    memory_backend.fs.pipe_file(path, b"not a pickle")
    _assert_only_problem_names(verify(memory_backend.url), memory_backend.url + "/.metadata", None)


def test_a_record_that_contradicts_metadata_is_reported(memory_backend: Backend) -> None:
    save(_state(), memory_backend)
    metadata = _metadata(memory_backend)
    meta = metadata.state_dict_metadata["weight"]
    assert isinstance(meta, TensorStorageMetadata)
    meta.properties.dtype = torch.float64
    memory_backend.fs.pipe_file(
        memory_backend.fs._strip_protocol(memory_backend.url + "/.metadata"), pickle.dumps(metadata)
    )
    report = verify(memory_backend.url)
    assert [p.item for p in report.problems] == ["weight"]
    assert "torch.float32" in report.problems[0].what and "torch.float64" in report.problems[0].what


def test_nothing_at_the_url_is_an_error_naming_it(memory_backend: Backend) -> None:
    with pytest.raises(CheckpointNotFoundError) as raised:
        verify(memory_backend.url)
    assert memory_backend.url in str(raised.value)


def test_tensors_saved_without_checksums_are_counted_not_failed(memory_backend: Backend) -> None:
    save(_state(), memory_backend, checksums=False)
    report = verify(memory_backend.url)
    assert report.ok and report.tensors_checked == 0 and report.unchecked == 5


def test_a_checkpoint_written_by_torchs_own_writer_is_checked_and_its_damage_found(
    local_backend: Backend,
) -> None:
    dcp.save(_state(), storage_writer=FileSystemWriter(local_backend.url), no_dist=True)
    report = verify(local_backend.url)
    assert report.ok and report.tensors_checked == 3, report.problems
    _flip_tensor_byte(local_backend, "bias")
    assert [p.item for p in verify(local_backend.url).problems] == ["bias"]


def _run(backend: Backend, iterations: list[int]) -> Training:
    """Save ``iterations`` of a small training run under ``backend.url``; the training saved."""
    training = Training()
    with Checkpointer(backend.url, backend.storage_options) as ckpt:
        for iteration in iterations:
            training.run(1)
            ckpt.save(iteration, **training.keys())
    return training


def test_an_iteration_folder_verifies_every_key_and_reports_one_that_lost_its_metadata(
    memory_backend: Backend,
) -> None:
    _run(memory_backend, [3])
    folder = memory_backend.sub("iter_000000003")
    report = verify(folder)
    assert report.ok and report.kind == "iteration"
    assert sorted(report.checkpoints) == [f"{folder}/{k}" for k in ("model", "optim", "scheduler", "trainer")]
    memory_backend.fs.rm_file(memory_backend.fs._strip_protocol(f"{folder}/optim/.metadata"))
    report = verify(folder)
    _assert_only_problem_names(report, f"{folder}/optim/.metadata", None)
    assert "'optim'" in report.problems[0].what


def test_a_save_dirname_verifies_every_committed_iteration_and_notes_uncommitted_ones(
    memory_backend: Backend,
) -> None:
    _run(memory_backend, [1, 2])
    memory_backend.fs.pipe_file(
        memory_backend.fs._strip_protocol(memory_backend.sub("iter_000000009", "model", "x")), b""
    )
    report = verify(memory_backend.url)
    assert report.ok and report.kind == "run" and len(report.checkpoints) == 8
    assert any("iter_000000009" in note for note in report.notes)
    _flip_tensor_byte(memory_backend, "0.weight", memory_backend.sub("iter_000000001", "model"))
    assert [(p.item, "iter_000000001" in p.url) for p in verify(memory_backend.url).problems] == [
        ("0.weight", True)
    ]


def test_a_pointer_naming_an_uncommitted_iteration_is_a_problem(memory_backend: Backend) -> None:
    _run(memory_backend, [1, 2])
    memory_backend.fs.rm_file(
        memory_backend.fs._strip_protocol(memory_backend.sub("iter_000000002", ".commit.json"))
    )
    report = verify(memory_backend.url)
    _assert_only_problem_names(report, memory_backend.sub("latest_checkpoint.txt"), None)
    assert "iter_000000002" in report.problems[0].what


def test_a_tensor_sharded_by_two_ranks_has_every_chunk_checked(
    local_backend: Backend, tmp_path: Path
) -> None:
    run_ranks(_save_sharded_rows, 2, tmp_path, local_backend.url, local_backend.storage_options)
    report = verify(local_backend.url)
    # Two row shards of "sharded", plus "replicated" and "plain", each written once.
    assert report.ok and report.tensors_checked == 4, report.problems
    _flip_tensor_byte(local_backend, "sharded")
    assert [p.item for p in verify(local_backend.url).problems] == ["sharded"]
