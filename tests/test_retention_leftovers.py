"""Retention over many leftovers of failed saves: deleted in bulk, off the save, and waited for.

A crashed job can leave thousands of uncommitted ``iter_`` folders below the pointer. The first
save with ``keep_last_n`` must not spend a request per folder before it returns, and the
deletion that follows must go in bulk (S3's DeleteObjects: 1,000 keys a request).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dcp_fsspec import Checkpointer
from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.storage.transport.urls import resolve
from tests.conftest import Backend
from tests.test_listing_cost import _add_junk, requests  # noqa: F401 - the request counter fixture

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

LEFTOVERS = 300


def test_the_first_save_over_hundreds_of_leftovers_returns_after_a_bounded_number_of_requests_and_wait_deletes_them_in_bulk(
    s3_backend: Backend, requests: Counter[str]
) -> None:
    with Checkpointer(s3_backend.url, s3_backend.storage_options, keep_last_n=2) as ckpt:
        ckpt.save(5000, model={"w": torch.ones(4)})
        _add_junk(s3_backend, range(1, 1 + LEFTOVERS))
        requests.clear()
        ckpt.save(5001, model={"w": torch.ones(4) * 2})
        in_save = sum(requests.values())
        ckpt.wait()
        assert in_save < 30, requests
        assert requests["delete_objects"] == 1 and requests["delete_object"] == 0, requests
        assert ckpt.committed_iterations() == [5000, 5001]
    assert layout.list_iterations(resolve(s3_backend.url, s3_backend.storage_options)) == [5000, 5001]
