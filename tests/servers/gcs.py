"""A Google Cloud Storage JSON API on 127.0.0.1: the ``gcp-storage-emulator`` PyPI package.

gcsfs reaches it through ``endpoint_url``. Two quirks of the emulator matter to us: it answers
``501 Not Implemented`` to ``moveTo`` (gcsfs's rename) and it ignores ``ifGenerationMatch=0``
(exclusive create); neither is used by dcp_fsspec's write path.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
from collections.abc import Iterator
from typing import Any

from tests.servers import ServerUnavailable

# Processes a test starts (ranks, background savers) import gcsfs afresh: the fixture gives them
# this environment for the duration of the test.
ENVIRON = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
# The stock listen backlog (5) makes the emulator's single-threaded server drop connections
# when gcsfs opens many at once for parallel ranged reads; the client then stalls on retries.
_BACKLOG = 256


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def import_gcsfs() -> Any:
    """Import gcsfs with its experimental zonal/HNS bucket support off (the emulator lacks it).

    gcsfs reads ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` once, at import; the variable is restored
    right after, so no test sees it changed.
    """
    with _environ(**ENVIRON):
        try:
            import gcsfs
        except ImportError as e:
            raise ServerUnavailable("gs:// tests need gcsfs: pip install 'dcp-fsspec[gcs]'") from e
    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        raise RuntimeError(
            "gcsfs was imported earlier in this process with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT on; "
            "the GCS emulator needs it off (set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false)"
        )
    return gcsfs


class LocalGCSServer:
    """gcp-storage-emulator, in memory, in a thread of this process."""

    def __init__(self) -> None:
        self._server: Any = None
        self.endpoint_url = ""

    def start(self) -> LocalGCSServer:
        import_gcsfs()
        try:
            from gcp_storage_emulator.server import create_server
        except ImportError as e:
            raise ServerUnavailable(
                "gs:// tests need the GCS emulator: pip install gcp-storage-emulator"
            ) from e
        logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
        server = create_server("127.0.0.1", 0, in_memory=True)
        # The socket listens in the constructor, which start() runs; the class attribute is
        # restored once it has (no other HTTPServer in the process is affected afterwards).
        stock = http.server.HTTPServer.request_queue_size
        http.server.HTTPServer.request_queue_size = _BACKLOG
        try:
            server.start()
        finally:
            http.server.HTTPServer.request_queue_size = stock
        self._server = server
        host, port = server._api._httpd.server_address[:2]
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def storage_options(self) -> dict[str, Any]:
        """gcsfs options that reach this server (anonymous: the emulator checks no credentials)."""
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "dcp-fsspec-tests"}

    def create_bucket(self, bucket: str) -> None:
        gcsfs = import_gcsfs()
        fs = gcsfs.GCSFileSystem(**self.storage_options(), skip_instance_cache=True)
        fs.mkdir(bucket)
