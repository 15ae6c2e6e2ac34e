"""Sizes and rates in words a reader takes in at a glance: ``1.5 KiB``, ``820 MiB/s``.

Every layer prints sizes (the checkpointer's log lines, the command-line tools), so this sits at
the bottom. Binary units, one decimal, the unit chosen to fit the number.
"""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_rate(nbytes: float, seconds: float) -> str:
    """``nbytes`` over ``seconds`` as ``"12.3 MiB/s"``; ``"-"`` when no time passed."""
    return f"{human_bytes(nbytes / seconds)}/s" if seconds > 0 else "-"
