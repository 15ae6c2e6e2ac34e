"""A real S3 API on 127.0.0.1 (a moto server in a thread) for the demo, tests and benchmarks.

It needs the ``moto[server]`` package (the ``demo`` and ``test`` extras install it). The port is chosen
by the OS; nothing here listens on anything but loopback.
"""

from __future__ import annotations

import logging
from typing import Any

from dcp_fsspec.errors import MissingDriverError

ACCESS_KEY = "dcp-fsspec-local"
SECRET_KEY = "dcp-fsspec-local-secret"
REGION = "us-east-1"


class LocalS3Server:
    """A moto S3 server on 127.0.0.1; use :meth:`start` / :meth:`stop` or a ``with`` block."""

    def __init__(self) -> None:
        self._server: Any = None
        self.endpoint_url = ""

    def start(self) -> LocalS3Server:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as e:
            raise MissingDriverError(
                "the embedded S3 server needs moto: run `pip install 'dcp-fsspec[demo]'` "
                "(or `pip install 'moto[server]'`), or pass --url to use storage of your own"
            ) from e
        # werkzeug logs every request at INFO; the demo's output is not the place for them.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server.

        The read timeout is long because moto assembles a multipart upload in
        ``CompleteMultipartUpload`` before it answers, which for a large object takes longer
        than botocore's default 60 s on a slow machine.
        """
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": self.endpoint_url},
            "config_kwargs": {"read_timeout": 900, "connect_timeout": 10},
        }

    def environ(self) -> dict[str, str]:
        """Environment variables for clients that read their configuration from it."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def create_bucket(self, bucket: str) -> None:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )
        client.create_bucket(Bucket=bucket)
