"""What drivers' own exceptions mean: no credentials, an endpoint that cannot be reached, a
connection that dropped (which retries treat as transient).

The storage layer's one place for those types (botocore's, aiohttp's), so the CLI can say
what to do in one line. Only modules already imported are looked in, since an error cannot be
of a type never loaded, and nothing here imports a driver.
"""

from __future__ import annotations

import errno
import socket
import sys

from dcp_fsspec.errors import DcpFsspecError

# (module, class, advice)
NO_CREDENTIALS = (
    (
        "botocore.exceptions",
        "NoCredentialsError",
        'set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), pass \'{"key": …, "secret": …}\' '
        "in --storage-options, or '{\"anon\": true}' for a public bucket",
    ),
    (
        "botocore.exceptions",
        "PartialCredentialsError",
        "the credentials found are incomplete: set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        "(or fix the profile in ~/.aws)",
    ),
)
UNREACHABLE = (
    ("botocore.exceptions", "EndpointConnectionError"),
    ("botocore.exceptions", "ConnectTimeoutError"),
    ("aiohttp", "ClientConnectorError"),
)
# What a connection that never got through says, on the built-in OSError drivers raise.
UNREACHABLE_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT}


def _loaded(module: str, name: str) -> type[BaseException] | None:
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def credentials_advice(error: BaseException) -> str | None:
    """What to do when ``error`` says the driver found no (or incomplete) credentials; else None."""
    for module, name, advice in NO_CREDENTIALS:
        cls = _loaded(module, name)
        if cls is not None and isinstance(error, cls):
            return advice
    return None


def is_unreachable(error: BaseException) -> bool:
    """Whether ``error`` says a connection to the endpoint never got through."""
    if isinstance(error, (ConnectionRefusedError, socket.gaierror)):
        return True
    if (
        isinstance(error, OSError)
        and not isinstance(error, DcpFsspecError)
        and error.errno in UNREACHABLE_ERRNOS
    ):
        return True
    types = tuple(cls for cls in (_loaded(m, n) for m, n in UNREACHABLE) if cls is not None)
    return bool(types) and isinstance(error, types)


def is_network_error(error: BaseException) -> bool:
    """Connection-level failures of the HTTP stacks fsspec drivers use (botocore, aiohttp, http.client)."""
    kinds: list[type[BaseException]] = []
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError, IncompleteReadError

        kinds += [BotoConnectionError, HTTPClientError, IncompleteReadError]
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    try:
        from aiohttp import ClientConnectionError, ClientPayloadError

        kinds += [ClientConnectionError, ClientPayloadError]
    except ImportError:  # pragma: no cover - aiohttp comes with s3fs
        pass
    import http.client

    kinds += [http.client.IncompleteRead, http.client.RemoteDisconnected]
    return isinstance(error, tuple(kinds))
