"""An SFTP server on 127.0.0.1: OpenSSH's own ``sshd``, with a configuration of our own.

It runs as the current user with key authentication only: a host key and a client key are
generated into a temporary folder, next to the ``sshd_config`` that names them, so nothing of
the system's ssh setup is read or changed. sshd cannot bind port 0 and report it, so the OS
picks a free port first (bind to port 0, read it, close) and sshd gets that one; the rare clash
with another program taking it in between is retried. Without ``sshd`` (Debian package
``openssh-server``) the tests that need it are skipped with a message saying so.
"""

from __future__ import annotations

import collections
import getpass
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from tests.servers import ServerUnavailable, dying_with_parent, stop_process

_LISTENING = re.compile(r"Server listening on 127\.0\.0\.1 port (\d+)")


def find_sshd() -> str:
    """The absolute path of ``sshd`` (sshd re-executes itself, so it must be absolute)."""
    for candidate in (shutil.which("sshd"), "/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if candidate and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    raise ServerUnavailable("sftp:// tests need OpenSSH's sshd: install it (apt-get install openssh-server)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalSSHServer:
    """``sshd -D`` in a child process, serving SFTP to one generated client key."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self.port = 0
        self.username = getpass.getuser()
        self.client_key = ""

    def start(self) -> LocalSSHServer:
        sshd = find_sshd()
        try:
            import asyncssh
            import sshfs  # noqa: F401
        except ImportError as e:
            raise ServerUnavailable("sftp:// tests need sshfs: pip install sshfs") from e
        self._folder = tempfile.TemporaryDirectory(prefix="sshd-")
        folder = Path(self._folder.name)
        host_key, client_key = (
            asyncssh.generate_private_key("ssh-ed25519"),
            asyncssh.generate_private_key("ssh-ed25519"),
        )
        for path, data in (
            (folder / "host_key", host_key.export_private_key()),
            (folder / "client_key", client_key.export_private_key()),
            (folder / "authorized_keys", client_key.export_public_key()),
        ):
            path.write_bytes(data)
            path.chmod(0o600)
        self.client_key = str(folder / "client_key")
        if os.geteuid() == 0:
            # sshd started by root drops privileges into this empty folder (privilege separation).
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        attempts = []
        for _ in range(5):
            output = self._launch(sshd, folder, _free_port())
            if self.port:
                return self
            attempts.append(output)
            if "Address already in use" not in output:
                break
        self.stop()
        raise RuntimeError(f"sshd did not start:\n{attempts[-1]}")

    def _launch(self, sshd: str, folder: Path, port: int) -> str:
        config = folder / "sshd_config"
        config.write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {folder / 'host_key'}\n"
            f"PidFile {folder / 'sshd.pid'}\nAuthorizedKeysFile {folder / 'authorized_keys'}\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
            "Subsystem sftp internal-sftp\nMaxSessions 64\nMaxStartups 64\nLogLevel INFO\n"
        )
        process = subprocess.Popen(
            dying_with_parent([sshd, "-D", "-e", "-f", str(config)]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert process.stdout is not None
        seen = []
        # sshd says on stderr when it listens (or why it could not); read until one or the other.
        for line in process.stdout:
            seen.append(line)
            match = _LISTENING.search(line)
            if match:
                self._process, self.port = process, int(match.group(1))
                # Keep draining its log (one line per connection) so the pipe never fills.
                threading.Thread(target=collections.deque, args=(process.stdout, 0), daemon=True).start()
                return ""
        process.wait()
        return "".join(seen)

    def stop(self) -> None:
        stop_process(self._process)
        self._process = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def storage_options(self) -> dict[str, Any]:
        """sshfs options that reach this server (JSON-serializable, for the command line too)."""
        return {
            "host": "127.0.0.1",
            "port": self.port,
            "username": self.username,
            "client_keys": [self.client_key],
            "known_hosts": None,
        }

    def url(self, path: str) -> str:
        """The ``sftp://`` URL of an absolute path on this server."""
        return f"sftp://127.0.0.1:{self.port}{path}"
