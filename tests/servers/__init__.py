"""Real storage servers on 127.0.0.1 for the test suite, one module per backend.

Each class starts its server on a port the OS chose, says how fsspec reaches it
(``storage_options()``), and stops it again; ``conftest.py`` wraps each in a session fixture.
A server whose program cannot be found or installed raises :class:`ServerUnavailable`, whose
message says why and what to install, and the fixture turns that into a skip.
"""

from __future__ import annotations


class ServerUnavailable(RuntimeError):
    """The server's program is not installed here and cannot be installed."""
