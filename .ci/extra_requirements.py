"""Print one extra's requirements from pyproject.toml, one a line, for ``pip install -r``.

``make docs`` installs the ``docs`` extra this way: without the package and its dependencies
(torch), which ``pip install '.[docs]'`` would bring in. Usage: ``python .ci/extra_requirements.py docs``.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the Makefile installs tomli first
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extra: str, pyproject: Path = PYPROJECT) -> list[str]:
    """The requirements the extra lists; a KeyError naming the file for an extra it lacks."""
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    if extra not in extras:
        raise KeyError(f"{pyproject} has no extra {extra!r}; it has {', '.join(sorted(extras))}")
    return list(extras[extra])


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
