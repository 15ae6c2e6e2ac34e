"""This process's resident memory and its peak, from ``/proc/self`` (Linux).

Writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM`` (the peak) to the current RSS, so
a phase's peak is read without a sampling thread and without missing short spikes.
"""

from __future__ import annotations


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
