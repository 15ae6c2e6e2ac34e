"""Listing cost: deciding what is committed costs one listing, not requests per folder.

``save_dirname`` may hold thousands of ``iter_*`` folders that are not checkpoints (another
run's debris, a copy gone wrong). Retention, ``committed_iterations``, ``ls`` and ``prune`` decide from one
recursive listing which folders show a commit record and which keys show ``.metadata``, and
read only the records they need: the number of S3 requests is bounded, whatever the number of
folders. Measured by counting every request s3fs sends to the moto server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import s3fs
import torch

from dcp_fsspec import Checkpointer
from dcp_fsspec.checkpoint.commit import retention
from dcp_fsspec.storage.transport.urls import resolve
from dcp_fsspec.tools.ls import list_run
from dcp_fsspec.tools.prune import prune
from tests.conftest import Backend

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),
]

JUNK_FOLDERS = 2000


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Every S3 API call made while the test runs, by operation name."""
    counted: Counter[str] = Counter()
    real = s3fs.S3FileSystem._call_s3

    async def counting(self: s3fs.S3FileSystem, method: str, *args: Any, **kwargs: Any) -> Any:
        counted[method] += 1
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    yield counted


def _add_junk(backend: Backend, iterations: range) -> None:
    """Uncommitted iteration folders, each with a key folder holding one data file."""
    backend.fs.pipe({backend.sub(f"iter_{i:09d}", "model", "__0_0.distcp"): b"junk" for i in iterations})


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((16,), value), "step": int(value)}


@pytest.mark.slow
def test_committed_iterations_cost_one_listing_however_many_folders_there_are(
    s3_backend: Backend, requests: Counter[str]
) -> None:
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        ckpt.save(5, trainer=_state(5))
        _add_junk(s3_backend, range(10, 10 + JUNK_FOLDERS))
        requests.clear()
        assert ckpt.committed_iterations() == [5]
    # One listing (1,000 keys a page: 2,001 folders are three pages) and one record read.
    assert sum(requests.values()) < 10, requests


@pytest.mark.slow
def test_a_save_with_retention_over_thousands_of_junk_folders_costs_a_bounded_number_of_requests(
    s3_backend: Backend, requests: Counter[str]
) -> None:
    with Checkpointer(s3_backend.url, s3_backend.storage_options, keep_last_n=2) as ckpt:
        for iteration in (1, 2):
            ckpt.save(iteration, trainer=_state(iteration))
        # Newer than the pointer: folders retention leaves alone (they may be being written),
        # but which it used to look into one by one when deciding what to keep.
        _add_junk(s3_backend, range(100, 100 + JUNK_FOLDERS))
        requests.clear()
        ckpt.save(3, trainer=_state(3))
        saved = sum(requests.values())
        assert ckpt.committed_iterations() == [2, 3]
    assert saved < 30, requests


@pytest.mark.slow
def test_retention_decides_over_thousands_of_junk_folders_below_the_pointer_with_a_bounded_number_of_requests(
    s3_backend: Backend, requests: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first save of a run into a folder full of junk: fewer committed iterations than
    # keep_last_n, so every folder below the pointer is a candidate to keep.
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        ckpt.save(5000, trainer=_state(5000))
    _add_junk(s3_backend, range(1, 1 + JUNK_FOLDERS))
    # Deleting costs requests per folder, once (the next save finds nothing left); what must not
    # grow with the number of folders is deciding what to keep. So deletions are only recorded.
    doomed: list[int] = []
    monkeypatch.setattr(
        retention, "discard", lambda root, iterations, recorded: doomed.extend(iterations) or {}
    )
    root = resolve(s3_backend.url, s3_backend.storage_options)
    requests.clear()
    assert retention.apply_retention(root, 2) == list(range(1, 1 + JUNK_FOLDERS))
    assert sum(requests.values()) < 10, requests
    assert doomed == list(range(1, 1 + JUNK_FOLDERS))


LS_JUNK_FOLDERS = 200


def test_ls_and_prune_over_hundreds_of_junk_folders_cost_a_bounded_number_of_requests(
    s3_backend: Backend, requests: Counter[str]
) -> None:
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        for iteration in (1000, 1001, 1002):
            ckpt.save(iteration, trainer=_state(iteration))
    _add_junk(s3_backend, range(1, 1 + LS_JUNK_FOLDERS))
    requests.clear()
    listed = list_run(s3_backend.url, s3_backend.storage_options)
    assert [i.iteration for i in listed.iterations if i.committed] == [1000, 1001, 1002]
    assert len(listed.iterations) == LS_JUNK_FOLDERS + 3
    junk = listed.iterations[0]
    assert junk.size_bytes == 4 and "has no .commit.json" in str(junk.why_uncommitted), junk
    # One listing, the pointer, and one record read per committed iteration (not per folder).
    assert sum(requests.values()) < 15, requests
    requests.clear()
    pruned = prune(s3_backend.url, 2, s3_backend.storage_options, dry_run=True)
    assert pruned.deleted == [*range(1, 1 + LS_JUNK_FOLDERS), 1000]
    assert sum(requests.values()) < 15, requests
