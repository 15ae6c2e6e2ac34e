"""Real storage servers on 127.0.0.1 for the test suite, one module per backend.

Each class starts its server on a port the OS chose, says how fsspec reaches it
(``storage_options()``), and stops it again; ``conftest.py`` wraps each in a session fixture.
A server whose program cannot be found or installed raises :class:`ServerUnavailable`, whose
message says why and what to install, and the fixture turns that into a skip.
"""

from __future__ import annotations

import shutil
import subprocess


def dying_with_parent(command: list[str]) -> list[str]:
    """``command``, run so that it gets SIGTERM when the test process dies (where possible).

    A session fixture stops its server on teardown; this covers a test process that is killed
    (a timeout, ^C twice), so no server outlives the run. util-linux's ``setpriv`` sets the
    parent-death signal and execs the command; without it the command runs as is.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *command] if setpriv else command


class ServerUnavailable(RuntimeError):
    """The server's program is not installed here and cannot be installed."""


def stop_process(process: subprocess.Popen[str] | None) -> None:
    """Terminate a server process, killing it if it has not exited within 30 s."""
    if process is None:
        return
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
