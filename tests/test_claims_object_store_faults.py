"""GCS and Azure Blob through the fault-injecting proxy: the guarantees table's retry and
permanent-error rows, tested on the emulators as ``test_faults.py`` tests them on S3.

The GCS emulator and Azurite speak plain HTTP, so :class:`tests.faults.FaultyProxy` sits in front
of them as it sits in front of moto; the backend's storage options point at the proxy instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch

from dcp_fsspec import StorageError
from dcp_fsspec.storage.transport.retry import RetryPolicy
from tests.ckpt_helpers import save_twice_and_resume
from tests.conftest import Backend
from tests.faults import FaultyProxy
from tests.helpers import raises_through_dcp, save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

FAST = RetryPolicy(attempts=8, base_delay=0.01, max_delay=0.1, deadline=60)


def _through(backend: Backend, endpoint_url: str, proxy: FaultyProxy) -> Backend:
    """The same bucket or container, reached through the proxy in front of ``endpoint_url``
    (its scheme, host and port replaced; Azurite's keeps its account in the path)."""
    parts = urlsplit(endpoint_url)
    origin = f"{parts.scheme}://{parts.netloc}"
    options = {
        name: value.replace(origin, proxy.endpoint_url.rstrip("/")) if isinstance(value, str) else value
        for name, value in backend.storage_options.items()
    }
    assert options != backend.storage_options, "the proxy must be in the way"
    return Backend(f"{backend.name}-faulty", backend.url, {**options, "skip_instance_cache": True})


@pytest.fixture(params=["gcs", "azure"])
def faulty(request: pytest.FixtureRequest) -> Iterator[tuple[Backend, FaultyProxy]]:
    """A GCS bucket or an Azure container behind a proxy that fails nothing until asked."""
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    server: Any = request.getfixturevalue(f"{request.param}_server")
    with FaultyProxy(server.endpoint_url, seed=4321) as proxy:
        yield _through(backend, server.endpoint_url, proxy), proxy


# On Azure the SDK's own waits (15 s and more before its first retry) make it ~45 s: `slow` there,
# so Azure's retry row is checked in CI only; GCS keeps it in `make test`, S3 in test_faults.py.
@pytest.mark.parametrize("faulty", ["gcs", pytest.param("azure", marks=pytest.mark.slow)], indirect=True)
def test_a_checkpointer_saves_commits_and_resumes_through_transient_faults(
    faulty: tuple[Backend, FaultyProxy],
) -> None:
    """Guarantee row: 'transient faults (503 SlowDown, 5xx, dropped connections) are retried' (GCS, Azure)."""
    backend, proxy = faulty
    # A few faults only: the Azure SDK's own retries wait 15 s and more before their first retry.
    proxy.max_faults = 3
    with proxy.faults_at(0.15, kinds=("503", "500", "drop")):
        save_twice_and_resume(backend.url, backend.storage_options, retry=FAST)
    assert sum(proxy.faults.values()) == 3, proxy.faults


def test_bad_credentials_fail_a_save_at_once_naming_the_url(faulty: tuple[Backend, FaultyProxy]) -> None:
    """Guarantee row: 'permanent errors (403, 404, bad credentials, missing bucket) fail at once, naming the URL' (GCS, Azure)."""
    backend, proxy = faulty
    proxy.deny = True
    with raises_through_dcp(StorageError) as raised:
        save({"w": torch.ones(4)}, backend, retry=FAST)
    assert backend.url in str(raised.value)
    # Our policy never retries a 403: what the driver itself repeats stays far below FAST's 8 attempts.
    assert proxy.total_requests <= 4, proxy.log


def test_faults_that_never_clear_fail_a_save_within_the_policy_deadline(
    faulty: tuple[Backend, FaultyProxy],
) -> None:
    """Guarantee row: 'a call that keeps failing ends in bounded time, naming the URL' (GCS, Azure)."""
    backend, proxy = faulty
    policy = RetryPolicy(attempts=1000, base_delay=0.05, max_delay=0.2, deadline=2.0)
    with proxy.faults_at(1.0, kinds=("503",)), raises_through_dcp(StorageError) as raised:
        save({"w": torch.ones(4)}, backend, retry=policy)
    # The deadline, not the attempts, ended it: far fewer than 1,000 attempts were made.
    assert backend.url in str(raised.value) and "giving up" in str(raised.value)
    assert proxy.total_requests < 1000, proxy.total_requests
