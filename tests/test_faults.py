"""Transient faults: saves and loads through a proxy that throttles, errors and drops connections.

The S3 tests talk to the moto server through :class:`tests.faults.FaultyProxy` on 127.0.0.1.
s3fs and botocore retry on their own (measured with this proxy: a never-clearing ``503
SlowDown`` costs 25 PUTs and ~40 s per call before it surfaces; ``500 InternalError`` is retried
by botocore only); :class:`RetryPolicy` adds attempts after the driver gave up and a deadline per
call. Checks of the classification and the policy itself need no network.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError

from dcp_fsspec import StorageError
from dcp_fsspec.checkpoint.commit import pointer
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.format.names import POINTER_NAME
from dcp_fsspec.storage.transport.retry import RetryPolicy, is_transient
from dcp_fsspec.storage.transport.urls import resolve
from tests.ckpt_helpers import save_twice_and_resume
from tests.conftest import Backend
from tests.faults import FaultyProxy
from tests.helpers import load, raises_through_dcp, save
from tests.states import assert_state_equal, empty_like_state, sample_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MiB = 1024 * 1024
# Small parts and requests, so that one save and load make many requests for faults to hit.
# Multipart uploads (not one PUT per file), so that faults hit parts too.
SMALL_IO: dict[str, Any] = {"part_size": 5 * MiB, "multipart_threshold": 0, "max_inflight_bytes": 16 * MiB}
SMALL_READS: dict[str, Any] = {"max_request_bytes": MiB}
DEADLINE = 2.0
FAST = RetryPolicy(attempts=6, base_delay=0.01, max_delay=0.1, deadline=60)


def _client_error(status: int, code: str) -> ClientError:
    response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "PutObject")


def _caused_by(outer: OSError, cause: BaseException) -> OSError:
    outer.__cause__ = cause  # what s3fs's translate_boto_error does
    return outer


@pytest.fixture
def proxy(s3_server: LocalS3Server) -> Iterator[FaultyProxy]:
    with FaultyProxy(s3_server.endpoint_url, seed=1234) as running:
        yield running


@pytest.fixture
def faulty_s3(s3_backend: Backend, proxy: FaultyProxy) -> Backend:
    """The test's S3 bucket, reached through the proxy (no faults until a test asks for them)."""
    options = dict(s3_backend.storage_options, client_kwargs={"endpoint_url": proxy.endpoint_url})
    return Backend("s3-faulty", s3_backend.url, options)


def _without_driver_retries(backend: Backend) -> Backend:
    """botocore makes one attempt per call (s3fs still retries drops and SlowDown itself)."""
    config = dict(backend.storage_options["config_kwargs"], retries={"max_attempts": 1, "mode": "standard"})
    return Backend(backend.name, backend.url, dict(backend.storage_options, config_kwargs=config))


# -- classification ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        _caused_by(OSError(errno.EBUSY, "Please reduce your request rate."), _client_error(503, "SlowDown")),
        _caused_by(OSError(errno.EREMOTEIO, "internal"), _client_error(500, "InternalError")),
        _client_error(502, "BadGateway"),
        _client_error(429, "TooManyRequests"),
        _client_error(400, "RequestTimeout"),
        ConnectionResetError(104, "Connection reset by peer"),
        TimeoutError(),
        ConnectionClosedError(endpoint_url="http://127.0.0.1:1/x"),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1/x"),
    ],
    ids=lambda e: type(e).__name__ + "-" + str(getattr(e, "__cause__", "") or e)[:20],
)
def test_throttling_server_errors_and_dropped_connections_are_transient(error: BaseException) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        _caused_by(PermissionError("Access Key Id does not exist"), _client_error(403, "InvalidAccessKeyId")),
        _caused_by(FileNotFoundError("NoSuchBucket"), _client_error(404, "NoSuchBucket")),
        _caused_by(OSError(errno.EINVAL, "precondition"), _client_error(412, "PreconditionFailed")),
        _client_error(501, "NotImplemented"),
        FileNotFoundError("/no/such/file"),
        PermissionError("denied"),
        ValueError("bad argument"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
    ids=lambda e: type(e).__name__ + "-" + str(getattr(e, "__cause__", "") or e)[:20],
)
def test_client_errors_and_local_errors_are_permanent(error: BaseException) -> None:
    assert not is_transient(error)


# -- the policy on its own -----------------------------------------------------------------------


def _flaky(failures: list[BaseException], result: Any = "done") -> Any:
    calls: list[int] = []

    def fn() -> Any:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return result

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def test_policy_retries_transient_errors_until_the_call_succeeds() -> None:
    fn = _flaky([ConnectionResetError(), TimeoutError(), _client_error(503, "SlowDown")])
    assert FAST.call(fn, url="s3://b/x") == "done"
    assert len(fn.calls) == 4


def test_policy_raises_a_permanent_error_at_once_unchanged() -> None:
    denied = PermissionError("denied")
    fn = _flaky([denied])
    with pytest.raises(PermissionError) as info:
        FAST.call(fn, url="s3://b/x")
    assert info.value is denied and len(fn.calls) == 1


def test_policy_gives_up_after_its_attempts_naming_the_url_and_the_last_error() -> None:
    fn = _flaky([ConnectionResetError(104, "reset")] * 10)
    policy = RetryPolicy(attempts=3, base_delay=0, deadline=None)
    with pytest.raises(StorageError) as info:
        policy.call(fn, url="s3://bucket/ckpt/__0_0.distcp")
    message = str(info.value)
    assert "s3://bucket/ckpt/__0_0.distcp" in message and "3 attempt" in message and "reset" in message
    assert isinstance(info.value.__cause__, ConnectionResetError) and len(fn.calls) == 3


def test_policy_cancels_an_attempt_still_running_at_the_deadline() -> None:
    async def hangs() -> None:
        await asyncio.sleep(3600)

    policy = RetryPolicy(attempts=5, base_delay=0, deadline=0.2)
    start = time.monotonic()
    with pytest.raises(StorageError, match="s3://b/x.*deadline"):
        asyncio.run(policy.call_async(hangs, url="s3://b/x"))
    assert time.monotonic() - start < 30  # generous: the bound is the 0.2 s deadline


def test_policy_waits_grow_but_never_beyond_max_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    fn = _flaky([ConnectionResetError()] * 7)
    RetryPolicy(attempts=8, base_delay=0.1, max_delay=0.5, deadline=None).call(fn, url="s3://b/x")
    bounds = [min(0.5, 0.1 * 2**n) for n in range(7)]
    assert len(waits) == 7 and all(0 <= w <= b for w, b in zip(waits, bounds))


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"attempts": 1.5}, {"base_delay": -1}, {"deadline": 0}])
def test_policy_rejects_limits_that_make_no_sense(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)


# -- through the faulty proxy --------------------------------------------------------------------


def test_save_and_load_are_bit_exact_through_a_proxy_failing_a_quarter_of_requests(
    faulty_s3: Backend, proxy: FaultyProxy
) -> None:
    """Guarantee row: 'transient faults (503 SlowDown, 5xx, dropped connections) are retried' (S3)"""
    state = sample_state()
    with proxy.faults_at(0.25):
        save(state, faulty_s3, **SMALL_IO)
        loaded = load(empty_like_state(state), faulty_s3, **SMALL_READS)
    assert_state_equal(loaded, state)
    assert sum(proxy.faults.values()) >= 5, proxy.faults


def test_our_retries_carry_a_save_and_load_when_the_driver_gives_up(
    faulty_s3: Backend, proxy: FaultyProxy
) -> None:
    # With one botocore attempt, a 500 reaches s3fs, which does not retry it: only our layer does.
    backend = _without_driver_retries(faulty_s3)
    state = sample_state()
    with proxy.faults_at(0.3, kinds=("500", "503", "drop", "cut")):
        save(state, backend, retry=FAST, **SMALL_IO)
        loaded = load(empty_like_state(state), backend, retry=FAST, **SMALL_READS)
    assert_state_equal(loaded, state)
    assert proxy.faults["500"] >= 3, proxy.faults


def test_without_our_retries_the_same_faults_fail_the_save(faulty_s3: Backend, proxy: FaultyProxy) -> None:
    backend = _without_driver_retries(faulty_s3)
    with proxy.faults_at(1.0, kinds=("500",)), raises_through_dcp(OSError) as raised:
        save(sample_state(), backend, retry=None, **SMALL_IO)
    assert faulty_s3.url in str(raised.value)


def test_checkpointer_saves_commits_and_resumes_through_faults(
    faulty_s3: Backend, proxy: FaultyProxy
) -> None:
    # Its default RetryPolicy covers what botocore would have retried (and sleeps less).
    backend = _without_driver_retries(faulty_s3)
    with proxy.faults_at(0.15):
        save_twice_and_resume(backend.url, backend.storage_options)
    assert sum(proxy.faults.values()) >= 5, proxy.faults


@pytest.mark.parametrize("kind", ["503", "drop"])
def test_faults_that_never_clear_fail_a_save_within_the_policy_deadline(
    faulty_s3: Backend, proxy: FaultyProxy, kind: str
) -> None:
    """Guarantee row: 'a call that keeps failing ends in bounded time, naming the URL' (S3)"""
    policy = RetryPolicy(attempts=100, base_delay=0.05, max_delay=0.2, deadline=DEADLINE)
    start = time.monotonic()
    with proxy.faults_at(1.0, kinds=(kind,)), raises_through_dcp(StorageError) as raised:
        save(sample_state(), faulty_s3, retry=policy, **SMALL_IO)
    # Generous: a few calls in sequence, each bounded by the deadline (s3fs alone: ~40 s per call).
    assert time.monotonic() - start < 10 * DEADLINE
    assert faulty_s3.url in str(raised.value) and "giving up" in str(raised.value)


def test_faults_that_never_clear_fail_a_load_within_the_policy_deadline(
    faulty_s3: Backend, proxy: FaultyProxy
) -> None:
    state = sample_state()
    save(state, faulty_s3, **SMALL_IO)
    policy = RetryPolicy(attempts=100, base_delay=0.05, max_delay=0.2, deadline=DEADLINE)
    proxy.match = lambda method, path: method == "GET" and not path.endswith("metadata")  # ranged reads
    start = time.monotonic()
    with proxy.faults_at(1.0, kinds=("503", "drop")), raises_through_dcp(StorageError) as raised:
        load(empty_like_state(state), faulty_s3, retry=policy, **SMALL_READS)
    assert time.monotonic() - start < 10 * DEADLINE
    assert faulty_s3.url in str(raised.value) and "giving up" in str(raised.value)


def test_a_part_that_cannot_be_uploaded_stops_the_file_instead_of_sending_the_rest(
    faulty_s3: Backend, proxy: FaultyProxy
) -> None:
    proxy.match = lambda method, path: method == "PUT" and "partNumber=" in path
    policy = RetryPolicy(attempts=2, base_delay=0, deadline=1.0)
    state = {"w": torch.zeros(10 * 5 * MiB // 4)}  # ten 5 MiB parts in one file
    with proxy.faults_at(1.0, kinds=("503",)), raises_through_dcp(StorageError):
        save(
            state,
            faulty_s3,
            retry=policy,
            part_size=5 * MiB,
            multipart_threshold=0,
            max_inflight_bytes=10 * MiB,
            files_per_rank=1,
        )
    parts = {
        path.split("partNumber=")[1].split("&")[0] for method, path, _ in proxy.log if "partNumber=" in path
    }
    # Two parts fit the memory budget; one more may start as the first failure frees it.
    assert len(parts) <= 3, sorted(parts)


def test_bad_credentials_fail_at_once_with_the_url_and_no_retries(
    faulty_s3: Backend, proxy: FaultyProxy
) -> None:
    """Guarantee row: 'permanent errors (403, 404, bad credentials, missing bucket) fail at once, naming the URL' (S3)"""
    proxy.deny = True
    with raises_through_dcp(StorageError) as raised:
        save({"w": torch.ones(4)}, faulty_s3, retry=FAST)
    assert faulty_s3.url in str(raised.value) and isinstance(raised.value.__cause__, PermissionError)
    assert proxy.total_requests == 1
    # DCP reports a failed metadata read as its own AssertionError, with our message in it.
    with raises_through_dcp(Exception) as raised:
        load({"w": torch.ones(4)}, faulty_s3, retry=FAST)
    assert faulty_s3.sub(".metadata") in str(raised.value) and "Forbidden" in str(raised.value)
    assert proxy.total_requests == 3  # .metadata, then DCP's try of __0.metadata: once each


def test_a_pointer_write_whose_response_was_lost_is_recognised_not_repeated(
    faulty_s3: Backend, proxy: FaultyProxy
) -> None:
    root = resolve(faulty_s3.url, faulty_s3.storage_options, retry=FAST)
    pointer_puts = lambda method, path: method == "PUT" and path.endswith(POINTER_NAME)  # noqa: E731
    proxy.match, proxy.max_faults = pointer_puts, 2
    with proxy.faults_at(1.0, kinds=("cut",)):
        assert pointer.write_pointer(root, 3)  # If-None-Match: the PUT lands, its response is lost
        assert pointer.write_pointer(root, 5)  # If-Match on the ETag read: the same
    assert pointer.read_pointer(root) == 5
    puts = [fault for method, path, fault in proxy.log if pointer_puts(method, path)]
    # Each first PUT was cut after it landed; its retry was refused (412), then a re-read saw it.
    assert puts.count("cut") == 2 and len(puts) >= 4, puts
