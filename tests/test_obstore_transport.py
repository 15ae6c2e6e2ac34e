"""The obstore transport: how it is chosen, and the s3fs options it maps or refuses.

The shared suites (the ``s3_obstore`` backend in conftest.py) check every guarantee on it; here
is what only this transport has.
"""

from __future__ import annotations

import pytest

from dcp_fsspec.errors import InvalidURLError, StorageError
from dcp_fsspec.storage.transport.urls import resolve
from tests.conftest import Backend

pytest.importorskip(
    "obstore", reason="the obstore transport needs obstore: pip install 'dcp-fsspec[obstore]'"
)


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
