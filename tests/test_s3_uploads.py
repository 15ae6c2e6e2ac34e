"""S3 uploads: one PUT or a multipart upload per file, and integrity on the wire without SHA-256.

Requests are counted and read on the real botocore client (its event hooks see every request
it sends to the moto server); a damaged body is sent to a real S3 server that checks bodies
against their checksum header (SeaweedFS, where its ``weed`` program is installed). The pointer's
compare-and-swap runs on moto and on each production S3 server that runs here.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import uuid
import zlib
from typing import Any

import fsspec
import pytest
import torch

from dcp_fsspec.storage.backends.base import Versioned
from dcp_fsspec.storage.backends.s3 import S3Backend
from dcp_fsspec.storage.backends.s3_uploads import CHECKSUM_ALGORITHM, checksum_header
from dcp_fsspec.storage.backends.uploads import ByteBudget, publish_whole
from dcp_fsspec.storage.transport.retry import NO_RETRY
from tests.conftest import Backend
from tests.helpers import load, save
from tests.servers.s3gateway import S3Gateway
from tests.servers.tls import TlsFront

MiB = 1024 * 1024
CHECKSUM_HEADER = f"x-amz-checksum-{CHECKSUM_ALGORITHM.lower()}"


class Requests:
    """Every request the filesystem's botocore client sends: operation name and headers."""

    def __init__(self, fs: Any) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []
        client = fsspec.asyn.sync(fs.loop, fs.set_session)
        client.meta.events.register("before-send.s3", self._record, unique_id=f"test-{id(self)}")

    def _record(self, request: Any, event_name: str, **_: Any) -> None:
        operation = event_name.rsplit(".", 1)[-1]  # before-send.s3.PutObject
        headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        self.seen.append((operation, headers))

    def names(self) -> list[str]:
        return [name for name, _ in self.seen]

    def bodies(self) -> list[dict[str, str]]:
        """Headers of the requests that carried data."""
        return [headers for name, headers in self.seen if name in ("PutObject", "UploadPart")]


def _crc(data: bytes) -> str:
    """The checksum header's value for ``data``, computed here rather than by the code under test."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def _fs(backend: Backend, *, through: TlsFront | None = None, **config: Any) -> Any:
    """A client of its own for ``backend``, with botocore ``config``; ``through`` a TLS front:
    over ``https://``, its certificate verified."""
    options = {**backend.storage_options, "skip_instance_cache": True}
    options["config_kwargs"] = {**options.get("config_kwargs", {}), **config}
    if through is not None:
        options["client_kwargs"] = {"endpoint_url": through.endpoint_url, "verify": through.ca_file}
    return fsspec.filesystem("s3", **options)


def _upload(
    fs: Any, url: str, pieces: list[bytes] | list[memoryview], *, part_size: int, threshold: int
) -> None:
    path = fs._strip_protocol(url)
    upload = S3Backend(fs, NO_RETRY).new_upload(
        path, part_size=part_size, budget=ByteBudget(64 * MiB), multipart_threshold=threshold
    )
    publish_whole(upload, [memoryview(p) for p in pieces])


@pytest.mark.parametrize(
    ("sizes_mib", "threshold_mib", "requests"),
    [
        ([1, 2], 8, ["PutObject"]),  # under the threshold: one request
        ([7], 8, ["PutObject"]),  # over a part, under the threshold: still one
        ([4], 0, ["PutObject"]),  # not even one full part: one request whatever the threshold
        (
            [6, 6],
            8,
            ["CreateMultipartUpload", "UploadPart", "UploadPart", "UploadPart", "CompleteMultipartUpload"],
        ),
        ([7], 0, ["CreateMultipartUpload", "UploadPart", "UploadPart", "CompleteMultipartUpload"]),
    ],
)
def test_a_file_goes_up_in_one_put_up_to_the_threshold_and_in_parts_above_it(
    s3_backend: Backend, sizes_mib: list[int], threshold_mib: int, requests: list[str]
) -> None:
    fs = _fs(s3_backend)
    seen = Requests(fs)
    pieces = [os.urandom(n * MiB) for n in sizes_mib]
    url = s3_backend.sub("f")
    _upload(fs, url, pieces, part_size=5 * MiB, threshold=threshold_mib * MiB)
    assert seen.names() == requests
    assert fs.cat_file(url) == b"".join(pieces)


def test_over_http_bodies_go_unsigned_with_a_checksum_the_server_keeps(s3_backend: Backend) -> None:
    assert s3_backend.storage_options["client_kwargs"]["endpoint_url"].startswith("http://")
    fs = _fs(s3_backend)
    seen = Requests(fs)
    small, large = os.urandom(3 * MiB), os.urandom(11 * MiB)
    _upload(fs, s3_backend.sub("small"), [small], part_size=5 * MiB, threshold=8 * MiB)
    _upload(fs, s3_backend.sub("large"), [large[: 4 * MiB], large[4 * MiB :]], part_size=5 * MiB, threshold=0)
    bodies = seen.bodies()
    assert len(bodies) == 4  # one PUT, three parts
    for headers in bodies:
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        assert CHECKSUM_HEADER in headers
        assert "content-md5" not in headers
    # Each checksum is that of its own body (the server checks it: see the damaged-body test).
    sent = [headers[CHECKSUM_HEADER] for headers in bodies]
    expected = [small, large[: 5 * MiB], large[5 * MiB : 10 * MiB], large[10 * MiB :]]
    assert sent == [_crc(b) for b in expected]
    assert fs.cat_file(s3_backend.sub("large")) == large


def test_payload_signing_chosen_by_the_user_is_left_as_it_is(s3_backend: Backend) -> None:
    fs = _fs(s3_backend, s3={"payload_signing_enabled": True})
    seen = Requests(fs)
    data = os.urandom(2 * MiB)
    _upload(fs, s3_backend.sub("signed"), [data], part_size=5 * MiB, threshold=8 * MiB)
    (headers,) = seen.bodies()
    assert headers["x-amz-content-sha256"] == hashlib.sha256(data).hexdigest()  # signed, as asked
    assert fs.cat_file(s3_backend.sub("signed")) == data


@pytest.mark.parametrize("chosen_in", ["config", "environment"])
def test_checksums_only_when_required_by_the_user_leave_the_bodies_without_ours(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch, chosen_in: str
) -> None:
    """``request_checksum_calculation="when_required"`` is what users of S3-compatible stores set
    when the store refuses checksum headers: ours are left off too."""
    if chosen_in == "environment":
        monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        fs = _fs(s3_backend)
    else:
        fs = _fs(s3_backend, request_checksum_calculation="when_required")
    seen = Requests(fs)
    data = os.urandom(6 * MiB)
    _upload(fs, s3_backend.sub("plain"), [data], part_size=5 * MiB, threshold=0)
    assert fs.cat_file(s3_backend.sub("plain")) == data
    assert len(seen.bodies()) == 2
    assert all(CHECKSUM_HEADER not in headers for headers in seen.bodies())


def test_over_https_bodies_go_as_they_are_with_our_checksum_not_botocores_chunked_trailer(
    s3_backend: Backend,
) -> None:
    """Left to itself, botocore sends an https body ``aws-chunked``: re-framed as it is read,
    with a CRC-32 trailer it computes on the way. Ours carry the CRC-32 the records' pass
    computed, as a header, and go unsigned and unframed: no byte is read twice."""
    with TlsFront(s3_backend.storage_options["client_kwargs"]["endpoint_url"]) as front:
        fs = _fs(s3_backend, through=front)
        seen = Requests(fs)
        small, large = os.urandom(3 * MiB), os.urandom(11 * MiB)
        _upload(fs, s3_backend.sub("small"), [small], part_size=5 * MiB, threshold=8 * MiB)
        _upload(
            fs, s3_backend.sub("large"), [large[: 4 * MiB], large[4 * MiB :]], part_size=5 * MiB, threshold=0
        )
        assert fs.cat_file(s3_backend.sub("small")) == small
        assert fs.cat_file(s3_backend.sub("large")) == large
    bodies = seen.bodies()
    assert len(bodies) == 4  # one PUT, three parts
    for headers in bodies:
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        assert "x-amz-trailer" not in headers and "content-encoding" not in headers  # not aws-chunked
    expected = [small, large[: 5 * MiB], large[5 * MiB : 10 * MiB], large[10 * MiB :]]
    assert [headers[CHECKSUM_HEADER] for headers in bodies] == [_crc(b) for b in expected]


def test_over_https_payload_signing_chosen_by_the_user_is_left_as_it_is(s3_backend: Backend) -> None:
    with TlsFront(s3_backend.storage_options["client_kwargs"]["endpoint_url"]) as front:
        fs = _fs(s3_backend, through=front, s3={"payload_signing_enabled": True})
        seen = Requests(fs)
        data = os.urandom(2 * MiB)
        _upload(fs, s3_backend.sub("signed"), [data], part_size=5 * MiB, threshold=8 * MiB)
        assert fs.cat_file(s3_backend.sub("signed")) == data
    (headers,) = seen.bodies()
    # botocore's own way, untouched: no header of ours; its trailer (which, over https, it
    # sends instead of a signature whatever the setting).
    assert CHECKSUM_HEADER not in headers
    assert headers["x-amz-trailer"] == CHECKSUM_HEADER


def test_a_request_body_is_read_as_views_of_its_buffers_not_copies() -> None:
    """aiohttp sends a body in 256 KiB reads; a joined body, or a read of a plain BytesIO,
    copies every byte again."""
    from dcp_fsspec.storage.backends.s3_uploads import _Body

    buffers = [bytearray(os.urandom(n)) for n in (300 * 1024, 5, 600 * 1024)]
    body = _Body([memoryview(b) for b in buffers])
    with body.getbuffer() as whole:  # aiohttp learns the length so
        assert len(whole) == sum(map(len, buffers))
    chunks = list(iter(lambda: body.read(256 * 1024), b""))
    # Views of the buffers themselves, one buffer at most per read.
    assert [next(i for i, b in enumerate(buffers) if memoryview(c).obj is b) for c in chunks] == [
        0,
        0,
        1,
        2,
        2,
        2,
    ]
    assert [len(c) for c in chunks] == [256 * 1024, 44 * 1024, 5, 256 * 1024, 256 * 1024, 88 * 1024]
    assert b"".join(chunks) == b"".join(buffers) and len(body.read(10)) == 0  # at the end: nothing more
    body.seek(0)  # a retried attempt reads it from the start again
    assert bytes(body.read()) == b"".join(buffers)
    body.seek(300 * 1024 + 2)
    assert bytes(body.read(100)) == bytes(buffers[1][2:])


def test_the_bodies_sent_are_views_of_the_buffers_written_not_joined_copies(s3_backend: Backend) -> None:
    fs = _fs(s3_backend)
    data = bytearray(os.urandom(11 * MiB))
    owners: list[set[int]] = []

    def body_owners(request: Any, **_: Any) -> None:
        if request.body is not None and not isinstance(request.body, bytes):
            owners.append({id(memoryview(c).obj) for c in iter(lambda: request.body.read(256 * 1024), b"")})
            request.body.seek(0)

    client = fsspec.asyn.sync(fs.loop, fs.set_session)
    client.meta.events.register("before-send.s3", body_owners, unique_id="test-body-owners")
    view = memoryview(data)
    _upload(fs, s3_backend.sub("one"), [view[: 3 * MiB]], part_size=5 * MiB, threshold=8 * MiB)
    _upload(fs, s3_backend.sub("parts"), [view[: 2 * MiB], view[2 * MiB :]], part_size=5 * MiB, threshold=0)
    assert owners == [{id(data)}] * 4  # one PUT, three parts: every chunk read from ``data`` itself
    assert fs.cat_file(s3_backend.sub("parts")) == data


@pytest.mark.parametrize(
    ("before", "size"),
    [
        (1000, 12 * MiB + 7),  # large pieces across two part boundaries: CRCs combined
        (5 * MiB - 100, 40 * 1024),  # a small piece, then a large one, across a boundary
        (5 * MiB - 3, 10),  # small pieces only
        (0, 5 * MiB),  # exactly one part
    ],
)
def test_a_records_crc_comes_from_the_same_pass_as_each_parts_checksum(
    s3_backend: Backend, before: int, size: int
) -> None:
    fs = _fs(s3_backend)
    seen = Requests(fs)
    head, data, tail = os.urandom(before), bytearray(os.urandom(size)), os.urandom(300)
    upload = S3Backend(fs, NO_RETRY).new_upload(
        fs._strip_protocol(s3_backend.sub("f")),
        part_size=5 * MiB,
        budget=ByteBudget(64 * MiB),
        multipart_threshold=0,
    )
    upload.write([head])
    crc = upload.write_checksummed(memoryview(data))
    upload.write([tail])
    upload.commit()
    assert crc == zlib.crc32(data)
    whole = head + data + tail
    parts = [whole[i : i + 5 * MiB] for i in range(0, len(whole), 5 * MiB)]
    assert [headers[CHECKSUM_HEADER] for headers in seen.bodies()] == [_crc(p) for p in parts]
    assert fs.cat_file(s3_backend.sub("f")) == whole


def test_a_tensor_saved_to_s3_in_parts_stores_the_crc_of_its_bytes(s3_backend: Backend) -> None:
    """The record's CRC is combined from the pieces the parts cut it into; torch's reader and
    ours check it."""
    from dcp_fsspec.storage.format.record_layout import descriptor_crc, parse_layout
    from dcp_fsspec.storage.format.tensor_records import tensor_bytes

    tensor = torch.randn(3 * MiB + 11)  # 12 MiB and a bit: three 5 MiB parts cut through it
    url = s3_backend.sub("ckpt")
    save({"t": tensor}, s3_backend, url, part_size=5 * MiB, multipart_threshold=0)
    fs = s3_backend.fs
    (name,) = [p for p in fs.ls(url, detail=False) if p.endswith(".distcp")]
    blob = fs.cat_file(name)
    layout = parse_layout(blob)
    assert layout is not None
    assert descriptor_crc(blob[layout.data_end :]) == zlib.crc32(tensor_bytes(tensor))
    loaded = load({"t": torch.zeros_like(tensor)}, s3_backend, url)
    assert torch.equal(loaded["t"], tensor)


def test_request_bytes_in_flight_stay_within_max_inflight_bytes(s3_backend: Backend) -> None:
    """Bodies copy nothing, but their bytes in flight (socket buffers, the server's) are what
    ``max_inflight_bytes`` bounds; counted from the client's own events, request by request."""
    fs = s3_backend.fs  # the writer below gets this cached filesystem
    client = fsspec.asyn.sync(fs.loop, fs.set_session)
    in_flight: dict[int, int] = {}
    most = 0

    def sent(request: Any, **_: Any) -> None:
        nonlocal most
        if isinstance(request.body, io.IOBase):
            in_flight[id(request.body)] = int(request.headers["Content-Length"])
            most = max(most, sum(in_flight.values()))

    def answered(request_dict: dict[str, Any], **_: Any) -> None:
        in_flight.pop(id(request_dict["body"]), None)

    client.meta.events.register("before-send.s3", sent, unique_id="test-in-flight-sent")
    client.meta.events.register("needs-retry.s3", answered, unique_id="test-in-flight-answered")
    try:
        state = {"w": torch.randn(10 * MiB)}  # 40 MiB: eight 5 MiB parts, two allowed at once
        save(
            state,
            s3_backend,
            s3_backend.sub("ckpt"),
            part_size=5 * MiB,
            multipart_threshold=0,
            max_inflight_bytes=10 * MiB,
        )
    finally:
        client.meta.events.unregister("before-send.s3", unique_id="test-in-flight-sent")
        client.meta.events.unregister("needs-retry.s3", unique_id="test-in-flight-answered")
    assert not in_flight  # every request sent was answered
    assert 5 * MiB <= most <= 10 * MiB


def test_the_bucket_is_checked_once_per_filesystem_not_at_every_save(s3_backend: Backend) -> None:
    seen = Requests(s3_backend.fs)  # the writers below reuse this cached filesystem
    for key in ("model", "optim", "model"):
        save({"w": torch.ones(3)}, s3_backend, s3_backend.sub(key), overwrite=True)
    assert seen.names().count("HeadBucket") == 1


# -- real S3 servers: SeaweedFS where installed, Ceph RGW where asked for (tests/conftest.py) ------


@pytest.fixture(params=["s3", "seaweedfs", "ceph"])
def any_s3(request: pytest.FixtureRequest) -> Backend:
    """moto, then each production S3 server that runs here."""
    return request.getfixturevalue(f"{request.param}_backend")


def test_the_pointer_is_replaced_only_while_it_holds_what_was_read(any_s3: Backend) -> None:
    """Ceph RGW 16.2 compares ``If-Match`` with the bare ETag: the quoted one GET returns is
    refused even when it matches, and without the fallback the pointer never moved again."""
    fs = _fs(any_s3)  # a filesystem of its own: nothing learnt about the server by other tests
    backend = S3Backend(fs, NO_RETRY)
    path = fs._strip_protocol(any_s3.sub("latest_checkpoint.txt"))
    assert backend.replace_if_unchanged(path, b"1", Versioned(None))  # absent: created
    assert not backend.replace_if_unchanged(path, b"x", Versioned(None))  # present: refused
    first = backend.read_versioned(path)
    assert backend.replace_if_unchanged(path, b"2", first)
    assert not backend.replace_if_unchanged(path, b"3", first)  # it moved on since that read
    assert backend.replace_if_unchanged(path, b"4", backend.read_versioned(path))
    assert not backend.replace_if_unchanged(path, b"5", first)
    assert fs.cat_file(path) == b"4"


def test_a_body_damaged_on_the_way_is_rejected_by_the_server(seaweedfs_server: S3Gateway) -> None:
    fs = fsspec.filesystem("s3", **seaweedfs_server.storage_options(), skip_instance_cache=True)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    data = os.urandom(1 * MiB)
    _upload(fs, f"s3://{bucket}/whole", [data], part_size=5 * MiB, threshold=8 * MiB)
    assert fs.cat_file(f"s3://{bucket}/whole") == data
    parts = os.urandom(11 * MiB)  # a multipart upload, its parts checked one by one
    _upload(fs, f"s3://{bucket}/parts", [parts], part_size=5 * MiB, threshold=0)
    assert fs.cat_file(f"s3://{bucket}/parts") == parts
    # The bytes the server receives differ from those the checksum was computed on.
    upload = S3Backend(fs, NO_RETRY).new_upload(
        f"{bucket}/damaged", part_size=5 * MiB, budget=ByteBudget(MiB)
    )
    damaged = bytes([data[0] ^ 1]) + data[1:]
    with pytest.raises(OSError, match="BadDigest|did not match|checksum"):
        fsspec.asyn.sync(
            fs.loop, upload._send, "put_object", [memoryview(damaged)], checksum_header(zlib.crc32(data))
        )
    assert not fs.exists(f"s3://{bucket}/damaged")
