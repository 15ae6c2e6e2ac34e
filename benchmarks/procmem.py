"""This process's resident memory and its peak, from ``/proc/self`` (Linux); the CPU time of
other processes (an S3 server's), from ``/proc/PID/stat``.

Writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM`` (the peak) to the current RSS, so
a phase's peak is read without a sampling thread and without missing short spikes.
"""

from __future__ import annotations

import os


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} is not in /proc/self/status")


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def peak_mib() -> float:
    return _status_kib("VmHWM") / 1024


def reset_peak() -> bool:
    """Start a new peak at the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_seconds(pids: list[int]) -> float:
    """user+sys seconds the processes ``pids`` (all their threads) have used so far; one that
    has exited counts 0."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                # Fields after the command name (which may hold spaces), from state on: utime
                # and stime are the 12th and 13th of them.
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")
