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
        capture_output=True, text=True, check=True,
    ).stdout
    status = dict(line.strip().rsplit(": ", 1) for line in listing.splitlines() if ": " in line)
    equivalent = set(re.findall(r"`(dcp_fsspec\.[^`]+__mutmut_\d+)`", EQUIVALENT.read_text()))
    counts = Counter(v for name, v in status.items() if name not in equivalent and v != "not checked")
    total = sum(counts.values())
    killed = counts["killed"]
    print(f"mutants checked: {total} (+{len(equivalent & set(status))} equivalent), " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    print(f"mutation score: {killed}/{total} = {100 * killed / max(total, 1):.1f}% killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
