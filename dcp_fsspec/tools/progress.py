"""A one-line progress bar on stderr, drawn only when stderr is a terminal.

Long copies and conversions report bytes as they go; pipes, log files and CI get nothing (their
readers want the summary line, not a hundred carriage returns). Thread-safe: parallel copies
advance it from several threads.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

_WIDTH = 30


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """``label [#######.......]  45%  1.2 GiB / 2.6 GiB``, redrawn when the percentage moves.

    Args:
        label: what is being done (``"copying"``).
        total: bytes expected; :meth:`add_total` may raise it later.
        stream: where to draw (default: ``sys.stderr``).
        enabled: draw or not; default: only when ``stream`` is a terminal.
    """

    def __init__(self, label: str, total: int = 0, *, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self._drawn = -1
        self._lock = threading.Lock()

    def add_total(self, n: int) -> None:
        with self._lock:
            self.total += n

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.enabled:
                self._draw()

    def close(self) -> None:
        """End the line the bar was drawn on (nothing if it never drew)."""
        with self._lock:
            if self.enabled and self._drawn >= 0:
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = -1

    def _draw(self) -> None:
        percent = 100 if self.total <= 0 else min(100, self.done * 100 // self.total)
        if percent == self._drawn:
            return
        self._drawn = percent
        filled = percent * _WIDTH // 100
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {percent:3d}%  "
            f"{human_bytes(self.done)} / {human_bytes(self.total)}\x1b[K"  # clear what a longer line left
        )
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False
