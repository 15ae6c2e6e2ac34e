"""What every S3 server of the suite and the benchmarks offers its clients, started or not.

:class:`S3Gateway` is an S3 endpoint on 127.0.0.1 with the credentials ``testing``/``testing``:
the options fsspec (s3fs) needs, the environment other clients read, and bucket creation. The
servers in :mod:`.seaweedfs` and :mod:`.ceph` are gateways they start themselves; a gateway
made with an endpoint only is a server someone else runs (``benchmarks --s3-endpoint``).
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

ACCESS_KEY = "testing"
SECRET_KEY = "testing"  # the servers' throwaway test identity, not a secret
REGION = "us-east-1"


class S3Gateway:
    """An S3 server at ``endpoint_url``; :meth:`start` and :meth:`stop` do nothing here."""

    name = "S3 endpoint"

    def __init__(self, endpoint_url: str = "", key: str = ACCESS_KEY, secret: str = SECRET_KEY) -> None:
        self.endpoint_url = endpoint_url
        self._key, self._secret = key, secret

    def start(self) -> S3Gateway:
        return self

    def stop(self) -> None:
        pass

    def __enter__(self) -> S3Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def server_pids(self) -> list[int]:
        """The processes that serve requests (for CPU accounting); none when not ours."""
        return []

    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach this server (long reads: a large upload completes slowly)."""
        return {
            "key": self._key,
            "secret": self._secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url},
            "config_kwargs": {"read_timeout": 900, "connect_timeout": 10},
        }

    def environ(self) -> dict[str, str]:
        """Environment variables for clients that read their configuration from it."""
        return {
            "AWS_ACCESS_KEY_ID": self._key,
            "AWS_SECRET_ACCESS_KEY": self._secret,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def create_bucket(self, bucket: str) -> None:
        import fsspec

        fs = fsspec.filesystem("s3", **self.storage_options(), skip_instance_cache=True)
        if not fs.exists(bucket):
            fs.mkdir(bucket)


def free_port(below: int = 65536) -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS's choice), under ``below``."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < below:
            return port
    raise RuntimeError(f"the OS offered no free port under {below}")


def wait_for_http(url: str, process: subprocess.Popen[str], what: str, timeout: float) -> None:
    """Wait until ``url`` answers any HTTP status (403 without credentials is an answer).

    Raises:
        RuntimeError: ``process`` exited, or ``timeout`` seconds passed first.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited ({process.returncode}) before {url} answered") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer at {url} within {timeout:.0f} s") from None
            time.sleep(0.25)
