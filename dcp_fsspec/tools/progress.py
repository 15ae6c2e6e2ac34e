"""A one-line progress bar on stderr, drawn only when stderr is a terminal.

Long copies, verifications and conversions report bytes and bytes/s as they go, and end on 100%;
pipes, log files and CI get nothing (their readers want the summary line, not a hundred carriage
returns). Thread-safe: parallel copies advance it from several threads.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from dcp_fsspec.storage.transport.units import human_bytes, human_rate

_WIDTH = 30
_REDRAW_SECONDS = 0.5


class Progress:
    """``label [#######.......]  45%  1.2 GiB / 2.6 GiB  85.3 MiB/s``, redrawn when the percentage
    moves (and at least every half second, for the rate).

    On a successful end (``with`` leaving without an exception) the last line says 100%: the total
    is an estimate made as the work was planned, the end is a fact. After an exception it says how
    far the work got.

    Args:
        label: what is being done (``"copying"``).
        total: bytes expected; :meth:`add_total` may raise it later.
        stream: where to draw (default: ``sys.stderr``).
        enabled: draw or not; default: only when ``stream`` is a terminal.
        clock: seconds, for the rate (a seam for tests).
    """

    def __init__(
        self,
        label: str,
        total: int = 0,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self._clock = clock
        self._started = clock()
        self._drawn = -1  # the percentage on screen; -1: nothing drawn
        self._drawn_at = self._started
        self._lock = threading.Lock()

    def add_total(self, n: int) -> None:
        with self._lock:
            self.total += n

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.enabled:
                self._draw(force=False)

    def close(self, *, finished: bool = True) -> None:
        """Draw the last line (100% if ``finished``) and end it; nothing if it never drew."""
        with self._lock:
            if self.enabled and self._drawn >= 0:
                if finished:
                    self.total = self.done
                self._draw(force=True)
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = -1

    def _draw(self, *, force: bool) -> None:
        percent = 100 if self.total <= 0 else min(100, self.done * 100 // self.total)
        now = self._clock()
        if not force and percent == self._drawn and now - self._drawn_at < _REDRAW_SECONDS:
            return
        self._drawn, self._drawn_at = percent, now
        filled = percent * _WIDTH // 100
        elapsed = now - self._started
        rate = human_rate(self.done, elapsed)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {percent:3d}%  "
            f"{human_bytes(self.done)} / {human_bytes(self.total)}  {rate}\x1b[K"  # clear what a longer line left
        )
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(finished=exc_type is None)


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False
