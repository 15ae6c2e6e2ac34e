"""A store that throttles is ridden out, not stampeded.

The limiter on its own, driven by events; then saves and loads through the Checkpointer
against :class:`~tests.servers.throttling.ThrottlingProxy` in front of moto, set well below
what they ask for.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dcp_fsspec import Checkpointer
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.settings import WriterSettings
from dcp_fsspec.storage.transport.concurrency import AdaptiveLimit, store_limit
from dcp_fsspec.storage.transport.retry import RetryPolicy
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.helpers import assert_throttling_that_never_clears_fails_in_one_line
from tests.servers.throttling import ThrottlingProxy, bucket_of, prefix_of

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),
]

MiB = 1024 * 1024
# Many 5 MiB parts of several files at once: far more requests a second than the proxy admits.
PARTS = WriterSettings(part_size=5 * MiB, multipart_threshold=5 * MiB)


# -- the limiter ---------------------------------------------------------------------------------


def test_requests_throttled_together_halve_the_limit_once() -> None:
    limit = AdaptiveLimit(ceiling=64)
    tickets = [limit.try_acquire() for _ in range(8)]
    for ticket in tickets:
        assert ticket is not None
        ticket.throttle()
    assert limit.limit == 4  # half of the 8 in flight, not 64 halved eight times
    for ticket in tickets:
        limit.release(ticket)
    assert limit.try_acquire() is not None


def test_a_throttled_request_sent_after_a_halving_halves_again_down_to_one() -> None:
    limit = AdaptiveLimit(ceiling=4)
    for expected in (2, 1, 1):
        ticket = limit.try_acquire()
        assert ticket is not None
        held = [limit.try_acquire() for _ in range(limit.limit - 1)]
        ticket.throttle()
        assert limit.limit == expected
        for t in [ticket, *held]:
            assert t is not None
            limit.release(t)


def test_the_limit_grows_back_by_one_every_few_successes_up_to_its_ceiling() -> None:
    limit = AdaptiveLimit(ceiling=3, grow_after=2)
    ticket = limit.try_acquire()
    assert ticket is not None
    ticket.throttle()
    limit.release(ticket)
    assert limit.limit == 1
    seen = []
    for _ in range(6):
        ticket = limit.try_acquire()
        assert ticket is not None
        limit.release(ticket)
        seen.append(limit.limit)
    assert seen == [1, 2, 2, 3, 3, 3]


def test_a_request_over_the_limit_waits_until_one_in_flight_ends() -> None:
    async def scenario() -> None:
        limit = AdaptiveLimit(ceiling=1)
        first = await limit.acquire()
        second = asyncio.ensure_future(limit.acquire())
        await asyncio.sleep(0)  # let it queue
        assert not second.done()
        limit.release(first)
        ticket = await second
        assert limit.in_flight == 1
        limit.release(ticket)

    asyncio.run(scenario())


# -- the proxy -----------------------------------------------------------------------------------


@pytest.fixture
def throttled_s3(s3_backend: Backend, s3_server: LocalS3Server) -> Iterator[tuple[Backend, ThrottlingProxy]]:
    """``s3_backend`` behind a proxy admitting 5 requests a second per prefix, 5 at once."""
    proxy = ThrottlingProxy(s3_server.endpoint_url, rate=5, burst=5).start()
    options = dict(s3_backend.storage_options)
    options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
    try:
        yield Backend("s3", s3_backend.url, options), proxy
    finally:
        proxy.stop()


def test_the_proxy_rates_a_request_by_its_key_up_to_the_last_slash() -> None:
    assert prefix_of("/bucket/run/iter_1/model/__0_0.distcp?partNumber=2") == "/bucket/run/iter_1/model/"
    assert prefix_of("/bucket?list-type=2") == "/"


def test_the_proxy_rates_every_request_to_a_bucket_as_one_prefix_when_asked() -> None:
    assert bucket_of("/bucket/run/iter_1/model/__0_0.distcp?partNumber=2") == "/bucket/"
    assert bucket_of("/bucket?list-type=2") == "/bucket/"


def test_the_proxy_answers_a_request_over_the_rate_with_s3s_slow_down(s3_server: LocalS3Server) -> None:
    proxy = ThrottlingProxy(s3_server.endpoint_url, rate=0, burst=1).start()
    try:
        urls = [f"{proxy.endpoint_url}/some-bucket/a/{name}" for name in ("x", "y")]
        with pytest.raises(urllib.error.HTTPError):  # moto: no such bucket, but it was admitted
            urllib.request.urlopen(urls[0])
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urls[1])
        assert refused.value.code == 503
        body = refused.value.read().decode()
        assert "<Code>SlowDown</Code><Message>Please reduce your request rate.</Message>" in body
        assert (proxy.admitted, proxy.refused) == (1, 1)
    finally:
        proxy.stop()


# -- saves and loads against it ------------------------------------------------------------------


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])


def _save_and_load(backend: Backend, retry: RetryPolicy) -> None:
    model, restored = _model(), _model()
    with Checkpointer(backend.url, backend.storage_options, retry=retry, writer_settings=PARTS) as ckpt:
        ckpt.save(1, model=model)
        ckpt.load(model=restored)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, restored.state_dict()[name]), name


def test_a_save_and_load_through_a_throttling_store_succeed_bit_exact_and_the_limit_drops(
    throttled_s3: tuple[Backend, ThrottlingProxy],
) -> None:
    backend, proxy = throttled_s3
    _save_and_load(backend, RetryPolicy())
    assert proxy.refused > 0
    assert store_limit(backend.fs).epoch > 0


def test_a_save_through_a_throttling_store_without_adaptive_limits_still_loads_bit_exact(
    throttled_s3: tuple[Backend, ThrottlingProxy],
) -> None:
    # s3fs retries a call that botocore gave up on with the same body: it must start over.
    backend, proxy = throttled_s3
    _save_and_load(backend, RetryPolicy(adaptive=False))
    assert proxy.refused > 0
    assert store_limit(backend.fs).epoch == 0


def test_throttling_that_never_clears_fails_in_one_line_naming_the_url_the_request_and_the_remedy(
    throttled_s3: tuple[Backend, ThrottlingProxy],
) -> None:
    # The kind as the driver's error names it (botocore: GetObject), else the request's verb.
    assert_throttling_that_never_clears_fails_in_one_line(*throttled_s3, "GetObject", "GET")


# -- several ranks against it --------------------------------------------------------------------

_KEYS = 2
_SAVES = 2


def _rank_state(rank: int, it: int) -> dict[str, dict[str, torch.Tensor]]:
    """Each key one small file per rank: a save asks for requests, not bytes."""
    generator = torch.Generator().manual_seed(rank * 1000 + it)
    return {f"k{k}": {f"r{rank}.w": torch.randn(4096, generator=generator)} for k in range(_KEYS)}


def _ranks_save_then_load_every_iteration(
    rank: int, world_size: int, url: str, options: dict[str, Any]
) -> None:
    with Checkpointer(url, options, retry=RetryPolicy()) as ckpt:
        for it in range(1, _SAVES + 1):
            ckpt.save(it, **_rank_state(rank, it))
    with Checkpointer(url, options, retry=RetryPolicy()) as ckpt:
        for it in range(1, _SAVES + 1):
            expected = _rank_state(rank, it)
            target = {k: {n: torch.empty_like(t) for n, t in d.items()} for k, d in expected.items()}
            assert ckpt.load(iteration=it, **target) == it
            for key, tensors in expected.items():
                for name, tensor in tensors.items():
                    assert torch.equal(target[key][name], tensor), (it, key, name)


@pytest.mark.slow
def test_four_ranks_save_and_load_every_iteration_bit_exact_through_a_bucket_throttled_below_demand(
    s3_server: LocalS3Server, s3_backend: Backend, tmp_path: Path
) -> None:
    """Every rank's requests share one rate, as under a new S3 bucket: far fewer a second than
    four ranks ask for at once. No save or load fails, and the store did refuse requests."""
    proxy = ThrottlingProxy(s3_server.endpoint_url, rate=10, burst=2, per_bucket=True).start()
    try:
        options = dict(s3_backend.storage_options)
        options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
        run_ranks(_ranks_save_then_load_every_iteration, 4, tmp_path, s3_backend.url, options)
    finally:
        proxy.stop()
    assert proxy.refused > 0
