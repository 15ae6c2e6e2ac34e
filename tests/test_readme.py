"""What a newcomer reads first: the README's order, its install text against pyproject.toml, and
its command-line block.

The dependency list and the extras table are written once, in the README's Install section;
docs/getting-started.md holds the same text, and both are checked against pyproject.toml here.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from dcp_fsspec import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```$", re.S | re.M)


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def install_text(page: str) -> str:
    """The page's install text: from "Install torch **before**" to the end of the extras table,
    with links made relative to docs/."""
    start = page.index("Install torch **before**")
    table = page.index("| extra |", start)
    end = page.find("\n\n", table)
    return page[start : end if end != -1 else len(page)].replace("](docs/", "](")


def listed_dependencies(page: str) -> set[str]:
    """The package names of the bullets after "Without extras it installs:"."""
    text = install_text(page)
    assert "Without extras it installs:\n" in text, (
        "the install text no longer introduces its list the same way"
    )
    after = text.split("Without extras it installs:\n", 1)[1].lstrip("\n")
    bullets = after.split("\n\n", 1)[0].splitlines()
    return {
        name
        for line in bullets
        if line.startswith("* ")
        for name in re.findall(r"`([\w.-]+)`", line.split(":", 1)[0])
    }


def tabled_extras(page: str) -> set[str]:
    """The extras the first column of the install text's table names."""
    rows = [line for line in install_text(page).splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([\w-]+)`", row.split("|")[1])}


def test_the_readme_and_getting_started_list_exactly_the_dependencies_of_pyproject() -> None:
    dependencies = {Requirement(line).name for line in _project()["dependencies"]}
    for page in (README, GETTING_STARTED):
        listed = listed_dependencies(page.read_text())
        assert listed == dependencies, (
            f"{page}: lists {sorted(listed)}, pyproject.toml has {sorted(dependencies)}"
        )


def test_the_extras_table_names_every_extra_of_pyproject_and_no_other() -> None:
    extras = set(_project()["optional-dependencies"])
    for page in (README, GETTING_STARTED):
        tabled = tabled_extras(page.read_text())
        assert tabled == extras, f"{page}: the table has {sorted(tabled)}, pyproject.toml {sorted(extras)}"


def test_getting_started_repeats_the_readmes_install_text_word_for_word() -> None:
    """One text in two places: a change to one that the other lacks fails here."""
    assert install_text(GETTING_STARTED.read_text()) == install_text(README.read_text())


def test_the_readme_links_the_documentation_before_install_and_the_long_sections() -> None:
    headings = re.findall(r"^## (.+)$", README.read_text(), re.M)
    assert headings.index("Documentation") < headings.index("Install") < headings.index("Quick start")
    assert headings.index("Quick start") < min(headings.index(h) for h in ("Guarantees", "Performance"))


def _cli_block() -> list[list[str]]:
    """The arguments of each ``dcp-fsspec`` line of the README's command-line block."""
    bash = [f["body"] for f in FENCE.finditer(README.read_text()) if f["lang"] == "bash"]
    block = next(body for body in bash if "dcp-fsspec ls" in body)
    lines = [line.split("#", 1)[0] for line in block.splitlines() if line.startswith("dcp-fsspec ")]
    return [shlex.split(line)[1:] for line in lines]


def test_the_readmes_command_line_block_shows_every_command() -> None:
    usage = cli.build_parser().format_usage()  # "... {ls,inspect,...} ...": what --help shows
    commands = set(re.search(r"\{([\w,-]+)\}", usage)[1].split(","))
    shown = {args[0] for args in _cli_block()}
    assert shown == commands, f"missing from the README's block: {sorted(commands - shown)}"


@pytest.mark.slow
def test_the_readmes_command_line_block_runs_as_pasted(tmp_path: Path) -> None:
    """Each line in turn, in an empty folder, through ``python -m dcp_fsspec``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    for args in _cli_block():
        done = subprocess.run(
            [sys.executable, "-m", "dcp_fsspec", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, (
            f"dcp-fsspec {shlex.join(args)} (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
        )
    assert (tmp_path / "model.pt").is_file() and (
        tmp_path / "hf-model" / "model.safetensors.index.json"
    ).is_file()
