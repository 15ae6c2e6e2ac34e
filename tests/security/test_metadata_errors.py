"""A ``.metadata`` entry that lies at no real place: our error is what ``dcp.load`` reports.

torch >= 2.9 swallows any failure of ``read_metadata`` and reports its own ``AssertionError``.
A record at a negative offset or of no length must reach the caller as our
``CorruptCheckpointError``, inside DCP's ``CheckpointException`` like a record past the file's
end, and as the same error from a ``Checkpointer``'s load.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsspec import Checkpointer, CorruptCheckpointError, FsspecStorageReader
from tests.conftest import Backend
from tests.helpers import save
from tests.security.crafted import edit_metadata, storage_entry

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

BAD_EXTENTS = [("length", 0), ("length", -100), ("offset", -1)]


@pytest.mark.parametrize(("field", "value"), BAD_EXTENTS)
def test_a_reader_used_again_after_a_record_at_no_real_place_loads_the_repaired_checkpoint(
    memory_backend: Backend, field: str, value: int
) -> None:
    save({"w": torch.arange(4.0)}, memory_backend)
    original: dict[str, int] = {}

    def damage(md: object) -> None:
        original[field] = getattr(storage_entry(md, "w"), field)
        setattr(storage_entry(md, "w"), field, value)

    url = edit_metadata(memory_backend, memory_backend.url, damage)
    reader = FsspecStorageReader(memory_backend.url, storage_options=memory_backend.storage_options)
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(4)}, storage_reader=reader, no_dist=True)
    edit_metadata(
        memory_backend, memory_backend.url, lambda md: setattr(storage_entry(md, "w"), field, original[field])
    )
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], torch.arange(4.0)), url


@pytest.mark.parametrize(("field", "value"), BAD_EXTENTS)
def test_dcp_load_and_a_checkpointer_load_report_a_record_at_no_real_place_as_our_error(
    memory_backend: Backend, field: str, value: int
) -> None:
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, model={"w": torch.arange(4.0)})
    key = memory_backend.sub("iter_000000001", "model")
    url = edit_metadata(memory_backend, key, lambda md: setattr(storage_entry(md, "w"), field, value))
    reader = FsspecStorageReader(key, storage_options=memory_backend.storage_options)
    with pytest.raises(CheckpointException) as raw:
        dcp.load({"w": torch.zeros(4)}, storage_reader=reader, no_dist=True)
    (first, _trace), *_ = raw.value.failures.values()
    assert isinstance(first, CorruptCheckpointError), repr(first)
    assert url in str(first) and "'w'" in str(first) and repr(value) in str(first)
    with Checkpointer(memory_backend.url) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(model={"w": torch.zeros(4)})
    assert url in str(info.value) and "'w'" in str(info.value)
