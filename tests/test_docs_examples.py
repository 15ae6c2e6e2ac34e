"""Every Python code block of README.md and docs/ runs as a user would paste it.

Each ```python block runs as a script of its own, in a fresh process and an empty folder. The
README's blocks run in every suite; those of docs/ run with the slow cases (each process imports
torch, which takes seconds), and a block that repeats an earlier one runs only there. A block
with ``title="name.py"`` is a script file: it is written under that name and run with the
``torchrun`` command of the next ```bash block that names it (2 gloo ranks, twice: a run, then a
resumed one). An HTML comment on the line before a block marks it: ``<!-- not run: why -->``
skips it (the reason shows in the report), ``<!-- slow: why -->`` runs it only with the slow
cases. A block that imports a framework which is not installed is skipped, naming it; the page
must name the extra that installs it before the block, since a reader without it gets only
``No module named ...``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.process_tree import signal_tree

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<attrs>[^\n]*)\n(?P<body>.*?)^```$", re.S | re.M)
MARK = re.compile(r"<!--\s*(?P<kind>not run|slow):\s*(?P<why>.+?)\s*-->\s*$")
TITLE = re.compile(r'title="(?P<name>[^"]+\.py)"')
IMPORT = re.compile(r"^\s*(?:from|import)\s+(?P<module>[\w.]+)", re.M)
# Each process's limit. A torchrun script runs twice, each within TIMEOUT. Every limit, with the
# grace given to a hung process to print its stacks, stays under pytest's own timeout: a hang
# then reports the stacks of the block's processes instead of only pytest's.
TIMEOUT, SLOW_TIMEOUT, STACKS_GRACE = 120, 240, 10
# Extras for developing this package: a user's page names the extra meant for users instead.
DEVELOPER_EXTRAS = {"test", "bench", "docs", "mutation"}


@dataclass(frozen=True)
class Block:
    """One fenced Python block, where it is, and how it is marked."""

    file: str
    line: int
    code: str
    mark: str  # "run", "slow" or "not run"
    why: str
    script: str  # the file name of a titled block, else ""
    command: str  # the torchrun line that runs a titled block

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def collect(path: Path, root: Path = ROOT) -> list[Block]:
    """The Python blocks of one Markdown file, named relative to ``root``."""
    text = path.read_text()
    fences = list(FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        if fence["lang"] not in ("python", "py"):
            continue
        line = text.count("\n", 0, fence.start()) + 1
        before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marked = MARK.search(before)
        mark, why = (marked["kind"], marked["why"]) if marked else ("run", "")
        titled = TITLE.search(fence["attrs"])
        script = titled["name"] if titled else ""
        command = ""
        if script:
            later = (f["body"] for f in fences[i + 1 :] if f["lang"] in ("bash", "sh", "console"))
            command = next(
                (c for body in later for c in body.splitlines() if "torchrun" in c and script in c), ""
            )
            mark = "slow" if mark == "run" else mark
        relative = str(path.relative_to(root))
        if mark == "run" and relative != "README.md":
            mark, why = "slow", "a docs/ page"
        blocks.append(Block(relative, line, fence["body"], mark, why, script, command))
    return blocks


def unique(blocks: list[Block]) -> list[Block]:
    """The blocks, each code only once: where it repeats, its first place stands for it."""
    seen: set[str] = set()
    kept = []
    for block in blocks:
        if block.code not in seen:
            seen.add(block.code)
            kept.append(block)
    return kept


BLOCKS = unique([block for page in _pages() for block in collect(page)])


def _missing_module(code: str) -> str | None:
    """The first top-level module the code imports that is not installed."""
    for match in IMPORT.finditer(code):
        top = match["module"].split(".")[0]
        if importlib.util.find_spec(top) is None:
            return top
    return None


def _run(args: list[str], cwd: Path, timeout: int, block: Block) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONFAULTHANDLER": "1",  # SIGABRT on a hang prints every thread's stack
    }
    with subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = signal_tree(process.pid, signal.SIGABRT)  # torchrun's workers too
            try:
                stdout, stderr = process.communicate(timeout=STACKS_GRACE)
            finally:
                signal_tree(process.pid, signal.SIGKILL, tree)
            pytest.fail(f"{block.id}: did not finish in {timeout} s; its stacks:\n{stdout}\n{stderr}")
    assert process.returncode == 0, f"{block.id} failed (exit {process.returncode}):\n{stdout}\n{stderr}"
    return stdout


def _params() -> list[object]:
    params: list[object] = []
    for block in BLOCKS:
        marks: list[pytest.MarkDecorator] = []
        if block.mark == "not run":
            marks.append(pytest.mark.skip(reason=f"not run: {block.why}"))
        elif block.mark == "slow":
            marks.append(pytest.mark.slow)
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_the_code_block_runs_as_pasted(block: Block, tmp_path: Path) -> None:
    """The block runs without error in an empty folder; a titled script runs under torchrun."""
    missing = _missing_module(block.code)
    if missing:
        pytest.skip(f"{block.id} needs {missing}, which is not installed")
    if not block.script:
        timeout = SLOW_TIMEOUT if block.mark == "slow" else TIMEOUT
        (tmp_path / "block.py").write_text(block.code)
        _run([sys.executable, "block.py"], tmp_path, timeout, block)
        return
    assert block.command, f"{block.id}: no ```bash block after it runs `torchrun ... {block.script}`"
    (tmp_path / block.script).write_text(block.code)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *block.command.split("torchrun", 1)[1].split("#")[0].split(),
    ]
    first = _run(torchrun, tmp_path, TIMEOUT, block)
    again = _run(torchrun, tmp_path, TIMEOUT, block)
    assert "resumed at 0" in first and "resumed at 0" not in again, (
        f"{block.id}: the second run did not resume:\n{again}"
    )


def test_the_collector_finds_every_kind_of_block() -> None:
    """The pages hold runnable blocks, a torchrun script, and only marked blocks are left out."""
    kinds = {mark: sum(b.mark == mark for b in BLOCKS) for mark in ("run", "slow", "not run")}
    assert kinds["run"] >= 2 and kinds["slow"] >= 5, kinds
    assert any(b.script and b.command for b in BLOCKS), "no torchrun example found"
    assert all(b.why for b in BLOCKS if b.mark == "not run"), "a block left out without a reason"


def test_a_block_marked_not_run_is_told_apart_from_one_that_runs(tmp_path: Path) -> None:
    """The collector reads the mark on the line before a fence, and only there; a repeated block
    counts once; outside README.md a block runs with the slow cases."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- not run: needs a cluster -->\n```python\nraise SystemExit(1)\n```\n\n"
        "text\n\n```python\nprint('ok')\n```\n```python\nprint('ok')\n```\n"
        '```python title="job.py"\nprint(1)\n```\n```bash\ntorchrun --nproc-per-node 2 job.py\n```\n'
    )
    blocks = unique(collect(page, root=tmp_path))
    assert [(b.mark, b.why, b.script) for b in blocks] == [
        ("not run", "needs a cluster", ""),
        ("slow", "a docs/ page", ""),
        ("slow", "", "job.py"),
    ]
    assert blocks[2].command == "torchrun --nproc-per-node 2 job.py"


def extras_by_module(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, set[str]]:
    """The user extras that install each top-level module no dependency installs.

    A requirement's import name is its name with ``-`` as ``_`` (``torch_checkpointing``).
    """
    project = tomllib.loads(pyproject.read_text())["project"]
    dependencies = {Requirement(line).name.lower() for line in project["dependencies"]}
    found: dict[str, set[str]] = {}
    for extra, lines in project["optional-dependencies"].items():
        for line in lines:
            name = Requirement(line).name.lower()
            if extra not in DEVELOPER_EXTRAS and name not in dependencies:
                found.setdefault(name.replace("-", "_"), set()).add(extra)
    return found


def unnamed_extras(block: Block, page: str, extras: dict[str, set[str]]) -> list[str]:
    """``module (extras)`` for each module the block imports whose extra the page does not name
    before it, as ``[extra]`` or "`extra` extra"."""
    before = "\n".join(page.splitlines()[: block.line - 1])
    missing = []
    for match in IMPORT.finditer(block.code):
        module = match["module"].split(".")[0]
        wanted = extras.get(module, set())
        if wanted and not any(f"[{e}]" in before or f"`{e}` extra" in before for e in wanted):
            missing.append(f"{module} ({', '.join(sorted(wanted))})")
    return missing


def test_a_block_importing_what_only_an_extra_installs_follows_the_name_of_that_extra() -> None:
    """Without the extra, such a block fails with ``No module named ...``: the page must have
    said which extra to install before it."""
    extras = extras_by_module()
    assert extras["safetensors"] == {"safetensors"} and "torch" not in extras and "moto" in extras
    problems = []
    for block in BLOCKS:
        page = (ROOT / block.file).read_text()
        for missing in unnamed_extras(block, page, extras):
            problems.append(f"{block.id}: imports {missing} without naming the extra before it")
    assert not problems, "\n".join(problems)


def test_the_extra_rule_sees_a_block_whose_page_names_no_extra(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Export:\n\n```python\nfrom safetensors.torch import load_file\n```\n")
    block = collect(page, root=tmp_path)[0]
    extras = extras_by_module()
    assert unnamed_extras(block, page.read_text(), extras) == ["safetensors (safetensors)"]
    named = "`pip install 'dcp-fsspec[safetensors]'` first.\n\n```python\nfrom safetensors.torch import load_file\n```\n"
    page.write_text(named)
    assert unnamed_extras(collect(page, root=tmp_path)[0], named, extras) == []
