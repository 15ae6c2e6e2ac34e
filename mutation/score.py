"""Print the mutation score of the last ``mutmut run`` (run in the folder it ran in).

Equivalent mutants (listed in mutation/EQUIVALENT.md) are taken out of the total, since no
test can tell them from the original; mutants of functions no selected test calls count as
survivors, and so do timeouts (a mutant that made the tests slow, or a child that hung).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

EQUIVALENT = Path(__file__).with_name("EQUIVALENT.md")


def main() -> int:
    listing = subprocess.run(
        [str(Path(sys.executable).with_name("mutmut")), "results", "--all", "true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    status = dict(line.strip().rsplit(": ", 1) for line in listing.splitlines() if ": " in line)
    equivalent = set(re.findall(r"`(dcp_fsspec\.[^`]+__mutmut_\d+)`", EQUIVALENT.read_text()))
    for module in sorted({_module(name) for name in status}):
        _report(module, {n: v for n, v in status.items() if _module(n) == module}, equivalent)
    _report("mutation score", status, equivalent)
    return 0


def _module(mutant: str) -> str:
    """``dcp_fsspec.checkpoint.commit.committing`` of ``dcp_fsspec.checkpoint.commit.committing.x_publish__mutmut_3``."""
    return mutant.split(".x")[0]


def _report(title: str, status: dict[str, str], equivalent: set[str]) -> None:
    counts = Counter(v for name, v in status.items() if name not in equivalent and v != "not checked")
    total, killed = sum(counts.values()), counts["killed"]
    parts = [f"{k}: {v}" for k, v in sorted(counts.items())]
    parts += [
        f"equivalent: {len(equivalent & set(status))}",
        f"not run: {sum(v == 'not checked' for v in status.values())}",
    ]
    print(f"{title}: {killed}/{total} = {100 * killed / max(total, 1):.1f}% killed ({', '.join(parts)})")


if __name__ == "__main__":
    sys.exit(main())
