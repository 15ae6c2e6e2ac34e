"""An Azure Blob Storage API on 127.0.0.1: Azurite, Microsoft's emulator (a Node.js program).

``azurite-blob`` is taken from ``PATH``, else from a per-user cache folder, where it is installed
with npm the first time (``npm install azurite``, about 15 s). Without npm the tests that need it
are skipped with a message saying so. Data lives in Azurite's memory only; the account is the
emulator's well-known development account.
"""

from __future__ import annotations

import collections
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from tests.servers import ServerUnavailable, dying_with_parent, stop_process

ACCOUNT_NAME = "devstoreaccount1"
# Azurite's published development key (the same in every installation; not a secret).
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_PACKAGE = "azurite@3.35.0"  # pinned: the version the suite was last run against
_LISTENING = re.compile(r"Azurite Blob service successfully listens on (http://\S+)")


def cache_dir() -> Path:
    """Where npm installs Azurite when it is not on PATH."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dcp-fsspec-tests" / "azurite"


def find_or_install_azurite() -> str:
    """The path of ``azurite-blob``, installing it into :func:`cache_dir` with npm if needed.

    Raises:
        ServerUnavailable: it is not on PATH and npm is not there to install it.
        RuntimeError: npm is there but the install failed (its output is in the message).
    """
    on_path = shutil.which("azurite-blob")
    if on_path:
        return on_path
    folder = cache_dir()
    program = folder / "node_modules" / ".bin" / "azurite-blob"
    if program.exists():
        return str(program)
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise ServerUnavailable(
            "az:// tests need Azurite, a Node.js program: install Node.js and npm "
            "(e.g. apt-get install nodejs npm) or put azurite-blob on PATH"
        )
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pytest process may be installing it now
        if not program.exists():
            done = subprocess.run(
                [
                    npm,
                    "install",
                    "--prefix",
                    str(folder),
                    "--no-audit",
                    "--no-fund",
                    "--no-save",
                    AZURITE_PACKAGE,
                ],
                capture_output=True,
                text=True,
                check=False,
                timeout=600,
            )
            if done.returncode != 0 or not program.exists():
                raise RuntimeError(
                    f"npm install {AZURITE_PACKAGE} into {folder} failed:\n{done.stdout}\n{done.stderr}"
                )
    return str(program)


class LocalAzurite:
    """``azurite-blob`` in a child process, listening on 127.0.0.1 on a port the OS chose."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._workspace: tempfile.TemporaryDirectory[str] | None = None
        self.endpoint_url = ""

    def start(self) -> LocalAzurite:
        try:
            import adlfs  # noqa: F401
        except ImportError as e:
            raise ServerUnavailable("az:// tests need adlfs: pip install 'dcp-fsspec[azure]'") from e
        program = find_or_install_azurite()
        self._workspace = tempfile.TemporaryDirectory(prefix="azurite-")
        self._process = subprocess.Popen(
            dying_with_parent(
                [
                    program,
                    "--blobHost",
                    "127.0.0.1",
                    "--blobPort",
                    "0",
                    "--inMemoryPersistence",
                    "--extentMemoryLimit",
                    "4096",
                    "--skipApiVersionCheck",
                    "--disableTelemetry",
                    "--silent",
                ]
            ),
            cwd=self._workspace.name,  # in case it writes anything despite --inMemoryPersistence
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen = []
        assert self._process.stdout is not None
        # Azurite prints the address it bound once it listens; until then, read its output.
        for line in self._process.stdout:
            seen.append(line)
            match = _LISTENING.search(line)
            if match:
                self.endpoint_url = f"{match.group(1).rstrip('/')}/{ACCOUNT_NAME}"
                break
        if not self.endpoint_url:
            code = self._process.wait()
            self.stop()
            raise RuntimeError(f"azurite-blob exited ({code}) before listening:\n{''.join(seen)}")
        # Keep draining its output so a full pipe never blocks it (closing the pipe instead
        # would make its next log line an EPIPE error).
        threading.Thread(target=collections.deque, args=(self._process.stdout, 0), daemon=True).start()
        return self

    def stop(self) -> None:
        stop_process(self._process)
        self._process = None
        if self._workspace is not None:
            self._workspace.cleanup()
            self._workspace = None

    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT_NAME};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={self.endpoint_url};"
        )

    def storage_options(self) -> dict[str, Any]:
        """adlfs options that reach this server."""
        return {"connection_string": self.connection_string()}

    def create_container(self, container: str) -> None:
        import adlfs

        fs = adlfs.AzureBlobFileSystem(**self.storage_options(), skip_instance_cache=True)
        fs.mkdir(container)
