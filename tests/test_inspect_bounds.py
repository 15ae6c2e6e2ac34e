"""``inspect`` of a big ``.metadata``: the first entries and the totals, ``--all`` for every one,
and ``--max-entries``, which stops the parse of a ``.metadata`` past that many entries."""

from __future__ import annotations

import gc
import json
import pickle
import sys
import tracemalloc
from typing import Any

import fsspec
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_fsspec import cli
from dcp_fsspec.errors import UsageError
from dcp_fsspec.storage.format.metadata_unpickler import unpickle_metadata
from dcp_fsspec.tools.inspection import describe
from tests.conftest import Backend

FIRST = 100  # what inspect lists of a key without --all


def _write_metadata(backend: Backend, entries: int) -> str:
    """A DCP ``.metadata`` of ``entries`` float32 tensors of 4 elements, one record each; its URL."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for i in range(entries):
        fqn = f"layer.{i:06d}.weight"
        size = torch.Size([4])
        chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size)
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [chunk])
        storage[MetadataIndex(fqn, torch.Size([0]))] = _StorageInfo("__0_0.distcp", 100 * i, 100)
    url = backend.sub(".metadata")
    fs, path = fsspec.core.url_to_fs(url, **backend.storage_options)
    fs.pipe_file(path, pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage)))
    return url


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_lists_the_first_entries_with_the_totals_and_every_entry_with_all(
    memory_backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = FIRST + 50
    _write_metadata(memory_backend, entries)
    code, out, _ = _run(capsys, "inspect", memory_backend.url)
    rows = [line for line in out.splitlines() if line.startswith("layer.")]
    assert code == 0 and len(rows) == FIRST and rows[0].startswith("layer.000000.weight ")
    assert f"{entries} tensors" in out and "... and 50 more entries (--all lists every entry)" in out
    code, out, _ = _run(capsys, "inspect", memory_backend.url, "--all")
    assert code == 0 and len([line for line in out.splitlines() if line.startswith("layer.")]) == entries
    code, out, _ = _run(capsys, "inspect", memory_backend.url, "--json")
    (key,) = json.loads(out)["keys"]
    assert len(key["entries"]) == FIRST and key["entry_count"] == entries
    assert key["tensors"] == entries and key["tensor_bytes"] == 16 * entries


def test_inspect_refuses_a_metadata_of_more_entries_than_max_entries_naming_it(
    memory_backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _write_metadata(memory_backend, 5)
    code, _, err = _run(capsys, "inspect", memory_backend.url, "--max-entries", "4")
    assert code == 2 and url in err and "more than 4 entries" in err and "--max-entries" in err
    code, out, _ = _run(capsys, "inspect", memory_backend.url, "--max-entries", "5")
    assert code == 0 and "5 tensors" in out
    with pytest.raises(UsageError, match="more than 4 entries") as info:
        describe(memory_backend.url, memory_backend.storage_options, max_entries=4)
    assert url in str(info.value)


def test_max_entries_stops_the_parse_before_it_holds_the_rest_of_the_metadata(
    memory_backend: Backend,
) -> None:
    url = _write_metadata(memory_backend, 20_000)
    fs, path = fsspec.core.url_to_fs(url)
    raw = fs.cat_file(path)

    def peak(max_entries: int | None) -> int:
        tracemalloc.start()
        try:
            try:
                unpickle_metadata(raw, url, max_entries=max_entries)
            except UsageError:
                pass
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    whole, stopped = peak(None), peak(100)
    assert stopped * 20 < whole, (stopped, whole)


def test_a_metadata_is_unpickled_with_the_garbage_collector_paused(memory_backend: Backend) -> None:
    url = _write_metadata(memory_backend, 5_000)
    fs, path = fsspec.core.url_to_fs(url)
    raw = fs.cat_file(path)
    collections: list[dict[str, int]] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        # Only a collection set off by the parse itself counts: there pickle's C code, called
        # from unpickle_metadata, is the one allocating (the first allocation after it may collect).
        if phase == "start" and sys._getframe(1).f_code is unpickle_metadata.__code__:
            collections.append(info)

    gc.callbacks.append(seen)
    try:
        unpickle_metadata(raw, url)
    finally:
        gc.callbacks.remove(seen)
    assert collections == [] and gc.isenabled()
