"""Throttling on the obstore transport reaches our retry policy and its limiter, as on s3fs.

Saves and loads through :class:`~tests.servers.throttling.ThrottlingProxy` in front of moto,
read and written through obstore, with the proxy set well below what they ask for.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from dcp_fsspec import Checkpointer
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.settings import WriterSettings
from dcp_fsspec.storage.transport.concurrency import store_limit
from dcp_fsspec.storage.transport.retry import RetryPolicy
from dcp_fsspec.storage.transport.urls import resolve
from tests.conftest import Backend
from tests.helpers import assert_throttling_that_never_clears_fails_in_one_line
from tests.servers.throttling import ThrottlingProxy

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),
]

MiB = 1024 * 1024
# Files of several 5 MiB parts: multipart uploads, and far more requests than the proxy admits.
PARTS = WriterSettings(part_size=5 * MiB, multipart_threshold=5 * MiB)


@pytest.fixture
def throttled_obstore(
    s3_obstore_backend: Backend, s3_server: LocalS3Server
) -> Iterator[tuple[Backend, ThrottlingProxy]]:
    """``s3_obstore_backend`` behind a proxy admitting 5 requests a second per prefix, 5 at once."""
    proxy = ThrottlingProxy(s3_server.endpoint_url, rate=5, burst=5).start()
    options = dict(s3_obstore_backend.storage_options)
    options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
    try:
        yield Backend("s3_obstore", s3_obstore_backend.url, options), proxy
    finally:
        proxy.stop()


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])


def test_a_save_and_load_through_obstore_and_a_throttling_store_succeed_bit_exact_and_the_limit_drops(
    throttled_obstore: tuple[Backend, ThrottlingProxy],
) -> None:
    backend, proxy = throttled_obstore
    location = resolve(backend.url, backend.storage_options)
    assert type(location.backend).__name__ == "ObstoreBackend"
    model, restored = _model(), _model()
    with Checkpointer(
        backend.url, backend.storage_options, retry=RetryPolicy(), writer_settings=PARTS
    ) as ckpt:
        ckpt.save(1, model=model)
        ckpt.load(model=restored)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, restored.state_dict()[name]), name
    assert proxy.refused > 0
    # Our limiter saw the throttling: obstore did not retry it out of sight.
    assert store_limit(location.fs).epoch > 0


def test_throttling_through_obstore_that_never_clears_fails_in_one_line_naming_the_url_and_throttling(
    throttled_obstore: tuple[Backend, ThrottlingProxy],
) -> None:
    assert_throttling_that_never_clears_fails_in_one_line(*throttled_obstore, "GET")
