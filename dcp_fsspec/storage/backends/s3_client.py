"""Hooks on the botocore client that s3fs makes, registered once per client.

A body under 16 MiB goes without ``Expect: 100-continue``. A body of ours starts again from
its first byte when s3fs calls again with it. A body that carries our CRC-32
header goes unsigned: the server checks that checksum, and no byte is read twice. Every
throttled answer, even one botocore or s3fs retries by itself, lowers the store's requests at
once (:mod:`~dcp_fsspec.storage.transport.concurrency`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import fsspec.asyn

from dcp_fsspec.storage.transport.concurrency import throttled_now
from dcp_fsspec.storage.transport.retry import is_throttling_answer

logger = logging.getLogger(__name__)

# botocore clients that carry our request hooks (:func:`hook_client`).
_HOOKED_CLIENTS: weakref.WeakSet[Any] = weakref.WeakSet()
# A client's config → the same with payload signing off (see _unsigned_if_checksummed).
_UNSIGNED_CONFIGS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
# A body at least this long is sent with ``Expect: 100-continue``: only after the server's go-ahead.
EXPECT_CONTINUE_FROM = 16 * 1024 * 1024


def hook_client(fs: Any) -> None:
    """Register :func:`_continue_only_for_large_bodies` on ``fs``'s botocore client, once per client.

    Where the client cannot be made here (a configuration it refuses, or a call from within
    fsspec's event loop), nothing is registered: the first request reports the problem as before.
    """
    client = getattr(fs, "_s3", None)
    if client is not None and client in _HOOKED_CLIENTS:
        return
    try:
        client = fsspec.asyn.sync(fs.loop, fs.set_session)
    except Exception as e:  # noqa: BLE001 - the requests that follow raise it in context
        logger.debug("S3 client hooks not registered for %s: %s", fs, e)
        return
    # Last among the handlers of "before-call.s3": after botocore's own, which adds the header.
    client.meta.events.register_last(
        "before-call.s3", _continue_only_for_large_bodies, unique_id="dcp-fsspec-expect"
    )
    client.meta.events.register("before-call.s3", _whole_body_each_call, unique_id="dcp-fsspec-rewind")
    client.meta.events.register("needs-retry.s3", _note_throttling, unique_id="dcp-fsspec-throttling")
    _HOOKED_CLIENTS.add(client)


def _whole_body_each_call(params: dict[str, Any], **_: Any) -> None:
    """botocore's before-call hook: a body of ours is sent from its start by every call.

    botocore rewinds a body between its own attempts, but s3fs retries a failed call with the
    same body, now read to its end: botocore would then send it empty (a 0-byte part).
    """
    body = params.get("body")
    if getattr(body, "whole_each_call", False):
        body.seek(0)


def _note_throttling(response: Any = None, **_: Any) -> None:
    """botocore's hook after each attempt: a throttled answer lowers the store's limit at once,
    not after the driver's own retries ran out."""
    if response is None:
        return
    http, parsed = response
    error = parsed.get("Error", {}) if isinstance(parsed, dict) else {}
    if is_throttling_answer(http.status_code, error.get("Code")):
        throttled_now()


def _continue_only_for_large_bodies(params: dict[str, Any], **_: Any) -> None:
    """botocore's before-call hook: no ``Expect: 100-continue`` on a body under
    :data:`EXPECT_CONTINUE_FROM` bytes.

    botocore asks for the server's go-ahead before every body it can stream (and ours stream),
    whatever its size: a round trip more for each PUT, which across a network is most of a small
    PUT's time (a small save's PUTs come one round after another: five round trips of its 15).
    The go-ahead spares sending a body the server refuses; that is worth a round trip only for
    a body that takes many to send.
    """
    from botocore.utils import determine_content_length  # s3fs brings botocore

    headers = params.get("headers") or {}
    if "Expect" in headers:
        length = determine_content_length(params.get("body"))
        if length is not None and length < EXPECT_CONTINUE_FROM:
            del headers["Expect"]


async def checksummed_bodies(fs: Any) -> bool:
    """Whether our uploads through ``fs``'s client send a checksum of their own and no SHA-256.

    Left to itself botocore makes a pass of its own over each byte: over ``http://`` it signs
    every body (a SHA-256 pass, besides the CRC-32 it adds); over ``https://``
    it sends the body ``aws-chunked``, re-framed chunk by chunk with a CRC-32 trailer it
    computes as it reads. Our bodies carry their S3 checksum header instead (the CRC-32 the
    records' pass computed already) and go unsigned as they are: the server still rejects a
    damaged body, and no byte is read twice. Unless the user chose otherwise (client config,
    AWS config file or environment): ``payload_signing_enabled``, or
    ``request_checksum_calculation="when_required"`` (the setting for S3-compatible stores
    that refuse checksums they do not require), leave botocore's way as it is.
    """
    client = await fs.set_session()
    config = client.meta.config
    if config.s3 and config.s3.get("payload_signing_enabled") is not None:
        return False
    if getattr(config, "request_checksum_calculation", None) == "when_required":
        return False
    for operation in ("PutObject", "UploadPart"):
        client.meta.events.register(
            f"before-sign.s3.{operation}",
            _unsigned_if_checksummed,
            unique_id=f"dcp-fsspec-unsigned-{operation}",
        )
    return True


def _unsigned_if_checksummed(request: Any, **_: Any) -> None:
    """botocore's before-sign hook: a body with an S3 checksum header goes unsigned."""
    if any(name.lower().startswith("x-amz-checksum-") for name in request.headers):
        from botocore.config import Config  # s3fs brings botocore; not every install has s3fs

        config = request.context["client_config"]
        unsigned = _UNSIGNED_CONFIGS.get(config)
        if unsigned is None:  # once per client: building a Config per request is costly
            unsigned = config.merge(Config(s3={**(config.s3 or {}), "payload_signing_enabled": False}))
            _UNSIGNED_CONFIGS[config] = unsigned
        request.context["client_config"] = unsigned
