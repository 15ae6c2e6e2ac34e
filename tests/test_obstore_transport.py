"""The obstore transport: how it is chosen, and the s3fs options it maps or refuses.

The shared suites (the ``s3_obstore`` backend in conftest.py) check every guarantee on it; here
is what only this transport has.
"""

from __future__ import annotations

import asyncio
import base64
import socket
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from dcp_fsspec import Checkpointer
from dcp_fsspec.errors import InvalidURLError, StorageError
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.backends.obstore_options import s3_options
from dcp_fsspec.storage.settings import WriterSettings
from dcp_fsspec.storage.transport.retry import RetryPolicy
from dcp_fsspec.storage.transport.urls import resolve
from tests.conftest import Backend
from tests.servers.proxy import LoopbackProxy
from tests.servers.throttling import _copy_body, _parse_head

pytest.importorskip(
    "obstore", reason="the obstore transport needs obstore: pip install 'dcp-fsspec[obstore]'"
)

MiB = 1024 * 1024
PARTS = WriterSettings(part_size=5 * MiB, multipart_threshold=5 * MiB)


def test_the_transport_option_reads_and_writes_through_obstore(s3_backend: Backend) -> None:
    location = resolve(s3_backend.url, {**s3_backend.storage_options, "transport": "obstore"})
    assert type(location.backend).__name__ == "ObstoreBackend"
    location.backend.write_small_atomic(location.join("a"), b"written by obstore")
    assert s3_backend.fs.cat_file(location.join("a")) == b"written by obstore"


def test_the_environment_chooses_obstore_only_for_the_urls_it_serves(
    s3_backend: Backend, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCP_FSSPEC_TRANSPORT", "obstore")
    assert type(resolve(s3_backend.url, s3_backend.storage_options).backend).__name__ == "ObstoreBackend"
    assert type(resolve(str(tmp_path)).backend).__name__ == "LocalBackend"


def test_the_transport_option_overrides_the_environment(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCP_FSSPEC_TRANSPORT", "obstore")
    location = resolve(s3_backend.url, {**s3_backend.storage_options, "transport": "fsspec"})
    assert type(location.backend).__name__ == "S3Backend"


def test_an_option_obstore_cannot_honour_is_refused_naming_it_and_the_url(s3_backend: Backend) -> None:
    options = {**s3_backend.storage_options, "transport": "obstore", "requester_pays": True}
    with pytest.raises(InvalidURLError) as raised:
        resolve(s3_backend.url, options)
    assert "requester_pays" in str(raised.value) and s3_backend.url in str(raised.value)


def test_an_unknown_client_kwarg_is_refused_naming_it(s3_backend: Backend) -> None:
    options = {"transport": "obstore", "client_kwargs": {"endpoint_url": "http://x", "verify": False}}
    with pytest.raises(InvalidURLError) as raised:
        resolve(s3_backend.url, options)
    assert "client_kwargs['verify']" in str(raised.value) and s3_backend.url in str(raised.value)


def test_an_unknown_transport_is_refused_naming_it_and_the_url(s3_backend: Backend) -> None:
    with pytest.raises(InvalidURLError) as raised:
        resolve(s3_backend.url, {**s3_backend.storage_options, "transport": "boto"})
    assert "'boto'" in str(raised.value) and s3_backend.url in str(raised.value)


def test_obstore_asked_for_a_scheme_it_does_not_serve_is_refused(tmp_path: object) -> None:
    url = f"file://{tmp_path}"
    with pytest.raises(InvalidURLError) as raised:
        resolve(url, {"transport": "obstore"})
    assert url in str(raised.value) and "transport" in str(raised.value)


def test_the_credentials_given_never_reach_the_refusal(s3_backend: Backend) -> None:
    options = {"transport": "obstore", "key": "AKIAHIDDEN", "secret": "s3cr3t-value", "profile": "x"}
    with pytest.raises(InvalidURLError) as raised:
        resolve(s3_backend.url, options)
    assert "s3cr3t-value" not in str(raised.value) and "AKIAHIDDEN" not in str(raised.value)


def test_a_missing_bucket_is_an_error_naming_the_url(s3_backend: Backend) -> None:
    url = "s3://no-such-bucket-here/ckpt"
    location = resolve(url, {**s3_backend.storage_options, "transport": "obstore"})
    with pytest.raises(StorageError) as raised:
        location.backend.make_folder(location.path)
    assert url in str(raised.value) and "bucket" in str(raised.value)


def test_an_adlfs_option_obstore_cannot_honour_is_refused_naming_it_and_the_url() -> None:
    url = "az://container/ckpt"
    with pytest.raises(InvalidURLError) as raised:
        resolve(url, {"transport": "obstore", "account_name": "a", "default_fill_cache": False})
    assert "default_fill_cache" in str(raised.value) and url in str(raised.value)


def test_an_azure_connection_string_part_obstore_cannot_honour_is_refused_without_the_key() -> None:
    text = "AccountName=acct;AccountKey=c2VjcmV0LWtleQ==;QueueEndpoint=http://127.0.0.1:1/acct"
    with pytest.raises(InvalidURLError) as raised:
        resolve("az://container/ckpt", {"transport": "obstore", "connection_string": text})
    assert "QueueEndpoint" in str(raised.value) and "c2VjcmV0LWtleQ" not in str(raised.value)


def test_obstore_asked_for_gcs_is_refused_naming_the_url() -> None:
    url = "gs://bucket/ckpt"
    with pytest.raises(InvalidURLError) as raised:
        resolve(url, {"transport": "obstore"})
    assert url in str(raised.value) and "transport" in str(raised.value)


# -- request bodies' checksums -------------------------------------------------------------------


class HeadersProxy(LoopbackProxy):
    """Forwards to ``upstream``, keeping each request's method, target and headers."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.requests: list[tuple[str, str, dict[str, str]]] = []

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_w.close()
            return
        responses = asyncio.ensure_future(self._pipe(server_r, client_w))
        try:
            while True:
                head = await client_r.readuntil(b"\r\n\r\n")
                self.requests.append(_parse_head(head))
                server_w.write(head)
                await _copy_body(client_r, self.requests[-1][2], server_w)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, asyncio.CancelledError):
            pass  # the client went away, or stop()
        finally:
            server_w.close()
            responses.cancel()
            client_w.close()

    def bodies(self) -> list[dict[str, str]]:
        """The headers of every request that sent a body (PUTs: whole files and parts)."""
        return [headers for method, _, headers in self.requests if method == "PUT"]


@pytest.fixture
def seen_obstore(s3_backend: Backend, s3_server: LocalS3Server) -> Iterator[tuple[Backend, HeadersProxy]]:
    """``s3_backend`` through obstore, behind a proxy that keeps every request's headers."""
    proxy = HeadersProxy(s3_server.endpoint_url).start()
    options = {**s3_backend.storage_options, "transport": "obstore"}
    options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
    try:
        yield Backend("s3_obstore", s3_backend.url, options), proxy
    finally:
        proxy.stop()


def _save_in_parts(backend: Backend) -> None:
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(4, 4))  # one file of 8 MiB, in parts
    with Checkpointer(backend.url, backend.storage_options, writer_settings=PARTS) as ckpt:
        ckpt.save(1, model=model)
        restored = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(4, 4))
        ckpt.load(model=restored)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), restored.parameters()))


def test_every_request_body_through_obstore_carries_its_sha256_for_the_server_to_check(
    seen_obstore: tuple[Backend, HeadersProxy],
) -> None:
    backend, proxy = seen_obstore
    _save_in_parts(backend)
    bodies = proxy.bodies()
    assert any("partNumber=" in target for method, target, _ in proxy.requests if method == "PUT")
    assert len(bodies) > 3  # parts, small files, the pointer
    for headers in bodies:
        assert len(base64.b64decode(headers["x-amz-checksum-sha256"])) == 32


def test_checksums_only_when_required_by_the_user_leave_obstores_bodies_without_one(
    seen_obstore: tuple[Backend, HeadersProxy],
) -> None:
    backend, proxy = seen_obstore
    options = dict(backend.storage_options)
    options["config_kwargs"] = {
        **options.get("config_kwargs", {}),
        "request_checksum_calculation": "when_required",
    }
    _save_in_parts(Backend("s3_obstore", backend.url, options))
    assert proxy.bodies()
    assert all("x-amz-checksum-sha256" not in headers for headers in proxy.bodies())


def test_payload_signing_turned_off_as_on_botocore_sends_bodies_unsigned_and_without_a_checksum(
    seen_obstore: tuple[Backend, HeadersProxy],
) -> None:
    backend, proxy = seen_obstore
    options = dict(backend.storage_options)
    options["config_kwargs"] = {**options.get("config_kwargs", {}), "s3": {"payload_signing_enabled": False}}
    _save_in_parts(Backend("s3_obstore", backend.url, options))
    assert proxy.bodies()
    for headers in proxy.bodies():
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        assert "x-amz-checksum-sha256" not in headers


def test_bodies_are_signed_over_http_only_as_botocore_signs_them() -> None:
    https = s3_options("s3://bucket/run", {"endpoint_url": "https://s3.example.com"})["config"]
    aws = s3_options("s3://bucket/run", {})["config"]
    http = s3_options("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9000"})["config"]
    assert https["unsigned_payload"] and aws["unsigned_payload"] and "checksum_algorithm" not in aws
    assert not http["unsigned_payload"] and http["checksum_algorithm"] == "sha256"


# -- errors obstore's requests end in ------------------------------------------------------------


def test_an_endpoint_refusing_connections_is_retried_under_the_policy_and_named_in_the_error(
    s3_backend: Backend,
) -> None:
    with socket.socket() as closed:  # a port the OS gave, then nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    options = {**s3_backend.storage_options, "transport": "obstore"}
    options["client_kwargs"] = {"endpoint_url": f"http://127.0.0.1:{port}"}
    retry = RetryPolicy(attempts=2, base_delay=0.01, deadline=10)
    location = resolve(s3_backend.url, options, retry=retry)
    with pytest.raises(StorageError) as raised:
        location.backend.read_versioned(location.join("latest_checkpoint.txt"))
    message = str(raised.value)
    assert f"{s3_backend.url}/latest_checkpoint.txt" in message
    assert "after 2 attempt(s)" in message and "ConnectionError" in message
