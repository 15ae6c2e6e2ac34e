"""Documented claims that had no test of their own: each test names the claim it checks.

The first test is the rule that keeps the guarantees table (docs/guarantees.md) honest: every cell of it that
promises something names a backend, and some test's docstring must name that row and backend as
``Guarantee row: '<the row's first cell>' (<backend>, ...)``.
"""

from __future__ import annotations

import ast
import errno
import os
import re
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import Checkpointer, FsspecStorageReader, FsspecStorageWriter, ResumeOptions, StorageError
from dcp_fsspec.storage.format import names
from dcp_fsspec.storage.write.file_plan import WriteContext
from tests.conftest import Backend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

ROOT = Path(__file__).resolve().parent.parent
# The table's columns, as the backend names a docstring uses ("GCS, Azure Blob" is two).
_COLUMNS = (("local",), ("S3",), ("GCS", "Azure"), ("memory",), ("SFTP",))
_NAMED = re.compile(r"Guarantee row: '(?P<row>.+?)' \((?P<backends>[^)]*)\)")


GUARANTEES = ROOT / "docs" / "guarantees.md"


def guarantee_cells(page: str) -> set[tuple[str, str]]:
    """(row, backend) for each cell of the guarantees page's table that promises something.

    A cell promises something unless it starts with "–" (does not apply) or "not guaranteed", or
    says "not tested" (the table then says itself what no test checks).
    The row is its first cell without backticks.
    """
    section = page.split("# Guarantees\n", 1)[1]
    lines = section.strip().split("\n\n", 1)[0].splitlines()
    header, _, *rows = lines
    assert len(header.strip("|").split("|")) == len(_COLUMNS) + 1, f"the table's columns changed: {header}"
    cells: set[tuple[str, str]] = set()
    for line in rows:
        row, *values = (cell.strip() for cell in line.strip().strip("|").split("|"))
        assert len(values) == len(_COLUMNS), f"a row with {len(values)} cells: {line}"
        for value, backends in zip(values, _COLUMNS):
            if not value.startswith(("–", "not guaranteed")) and "not tested" not in value:
                cells |= {(row.replace("`", ""), backend) for backend in backends}
    return cells


def named_guarantees(tests: Path) -> set[tuple[str, str]]:
    """(row, backend) for each ``Guarantee row: '...' (...)`` in a test function's docstring."""
    named: set[tuple[str, str]] = set()
    for path in tests.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                doc = " ".join((ast.get_docstring(node) or "").split())
                for match in _NAMED.finditer(doc):
                    named |= {(match["row"], b.strip()) for b in match["backends"].split(",")}
    return named


# Promises the table makes that no test checks yet: empty since issue 16 (round 2), and it stays
# so: a new promise comes with its test, or its cell says "not tested". A test that names an entry
# fails the rule below until the entry is taken off, and so does a new untested promise.
KNOWN_UNTESTED: set[tuple[str, str]] = set()


def test_every_promise_of_the_guarantees_table_is_named_by_a_test() -> None:
    """Each (row, backend) the guarantees table promises has a test that says it checks it."""
    promised = guarantee_cells(GUARANTEES.read_text())
    assert len(promised) > 40  # the parser found the table
    named = named_guarantees(ROOT / "tests")
    assert not named - promised, (
        f"docstrings name rows or backends the table does not have: {sorted(named - promised)}"
    )
    missing = promised - named
    assert missing <= KNOWN_UNTESTED, "no test docstring names these guarantee cells:\n" + "\n".join(
        f"  {r!r} ({b})" for r, b in sorted(missing - KNOWN_UNTESTED)
    )
    assert not KNOWN_UNTESTED - missing, (
        f"tested now, take them off KNOWN_UNTESTED: {sorted(KNOWN_UNTESTED - missing)}"
    )


def test_a_docstring_naming_a_row_the_table_does_not_have_is_caught() -> None:
    """The rule's own check: a misspelt row or backend would not count as naming a promise."""
    page = GUARANTEES.read_text()
    row = "bit flips in tensor data detected on load"
    assert (row, "SFTP") in guarantee_cells(page)
    assert ("ranged reads of the data files", "Azure") in guarantee_cells(page)
    broken = page.replace(
        "| bit flips in tensor data detected on load | CRC-32 per tensor |", "| bit flips | – |"
    )
    assert (row, "local") not in guarantee_cells(broken)


def test_a_ready_filesystem_can_be_passed_as_fs_instead_of_storage_options() -> None:
    """README, the storage layer: "a ready filesystem can be passed as `fs=` instead"."""
    fs = fsspec.filesystem("memory", skip_instance_cache=True)  # a store of its own
    state = {"w": torch.arange(10.0)}
    dcp.save(
        state,
        storage_writer=FsspecStorageWriter("memory://given/ckpt", _context=WriteContext(fs=fs)),
        no_dist=True,
    )
    assert fs.exists("/given/ckpt/.metadata")
    back = {"w": torch.zeros(10)}
    dcp.load(back, storage_reader=FsspecStorageReader("memory://given/ckpt", _fs=fs), no_dist=True)
    assert torch.equal(back["w"], state["w"])


def _record_fsyncs_and_renames(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """From now until ``monkeypatch.undo()``: ``("fsync", path)`` and ``("replace", "src -> dst")``
    for every ``os.fsync`` and ``os.replace``, in order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _renames(events: list[tuple[str, str]]) -> list[tuple[int, str, str]]:
    """(index in ``events``, temporary name, final name) of every rename."""
    renames = []
    for i, (kind, what) in enumerate(events):
        if kind == "replace":
            temp, target = what.split(" -> ", 1)
            renames.append((i, temp, target))
    return renames


def test_local_saves_fsync_every_file_before_its_rename_and_then_the_folder(
    local_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guarantees, local disk: "temp name + fsync + rename, folder fsynced" (sync_files=True)."""
    events = _record_fsyncs_and_renames(monkeypatch)
    dcp.save(
        {"w": torch.ones(64), "b": torch.zeros(3)},
        storage_writer=FsspecStorageWriter(local_backend.url),
        no_dist=True,
    )
    monkeypatch.undo()
    renames = _renames(events)
    assert {os.path.basename(target) for _, _, target in renames} >= {"__0_0.distcp", names.METADATA_NAME}
    for i, temp, target in renames:
        assert ("fsync", temp) in events[:i], f"{temp} renamed to {target} before it was fsynced"
        assert ("fsync", os.path.dirname(target)) in events[i + 1 :], (
            f"the folder of {target} was not fsynced after"
        )
    # .metadata commits a standalone checkpoint: the data file's name is durable before it is written.
    data_rename = next(i for i, _, target in renames if target.endswith(".distcp"))
    metadata_rename = next(i for i, _, target in renames if target.endswith(names.METADATA_NAME))
    assert ("fsync", local_backend.url) in events[data_rename + 1 : metadata_rename]


def test_a_checkpointer_save_is_durable_before_its_commit_record_with_one_fsync_per_key_folder(
    local_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guarantee row: 'a Checkpointer save's files survive a power loss once it is committed' (local).

    Every key's file is renamed into place at once and fsynced (on a thread of its own) before
    its key's folder; every key's folder after all its renames and before the commit record; the
    commit record and the pointer are fsynced before their renames; the commit record's folder
    before the pointer moves; the root after it. A key's folder is fsynced once per save (the
    commit record, not its .metadata, commits it), not once after its data and again after its
    .metadata."""
    keys = {"model": {"w": torch.ones(64)}, "optim": {"m": torch.zeros(3)}, "trainer": {"step": 3}}
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(1, **keys)
        events = _record_fsyncs_and_renames(monkeypatch)
        ckpt.save(2, **keys)
        monkeypatch.undo()
    root, folder = local_backend.url, os.path.join(local_backend.url, "iter_000000002")
    renames = _renames(events)
    record = next(i for i, _, target in renames if target == os.path.join(folder, names.COMMIT_RECORD_NAME))
    pointer = next(i for i, _, target in renames if target == os.path.join(root, "latest_checkpoint.txt"))
    for i, temp, target in renames:
        if target in (
            os.path.join(folder, names.COMMIT_RECORD_NAME),
            os.path.join(root, "latest_checkpoint.txt"),
        ):
            assert ("fsync", temp) in events[:i], f"{temp} renamed to {target} before it was fsynced"
    for key in keys:
        key_folder = os.path.join(folder, key)
        key_renames = [(i, target) for i, _, target in renames if os.path.dirname(target) == key_folder]
        assert len(key_renames) >= 2, f"{key}: its data file and .metadata"
        syncs = [i for i, event in enumerate(events) if event == ("fsync", key_folder)]
        assert len(syncs) == 1, f"{key_folder} fsynced {len(syncs)} times in one save"
        assert max(i for i, _ in key_renames) < syncs[0] < record, (
            f"{key_folder} not fsynced between its renames and the commit record"
        )
        for i, target in key_renames:
            assert ("fsync", target) in events[i + 1 : syncs[0]], f"{target} not fsynced before its folder"
    assert ("fsync", folder) in events[record + 1 : pointer], (
        "the commit record's rename not made durable before the pointer moved"
    )
    assert ("fsync", root) in events[pointer + 1 :], "the pointer's rename not made durable"


def test_a_key_file_whose_fsync_fails_fails_the_save_naming_it_and_the_pointer_stays(
    local_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Checkpointer's key files are fsynced off the writing thread, while the next key is
    written; a failed fsync there still fails the save, naming the file, before its commit
    record: the pointer stays on the last checkpoint, every file is closed, and the iteration
    saves again."""
    keys = {"model": {"w": torch.ones(64)}, "optim": {"m": torch.zeros(3)}, "trainer": {"step": 3}}
    real_fsync, failed = os.fsync, []

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if f"{os.sep}iter_000000002{os.sep}optim{os.sep}" in path and path.endswith(".distcp"):
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    def open_files_of(iteration: str) -> list[str]:
        paths = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                paths.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue  # the listing's own descriptor, closed since
        return [p for p in paths if f"{os.sep}{iteration}{os.sep}" in p]

    folder = os.path.join(local_backend.url, "iter_000000002")
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(1, **keys)
        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(StorageError) as raised:
            ckpt.save(2, **keys)
        monkeypatch.undo()
        assert len(failed) == 1 and failed[0] in str(raised.value) and "fsync" in str(raised.value)
        assert not os.path.exists(os.path.join(folder, names.COMMIT_RECORD_NAME))
        assert Path(local_backend.url, "latest_checkpoint.txt").read_text().strip() == "iter_000000001"
        assert open_files_of("iter_000000002") == []
        ckpt.save(2, **keys)
    target = {"w": torch.zeros(64)}
    with Checkpointer(local_backend.url) as ckpt:
        assert ckpt.load(model=target) == 2
    assert torch.equal(target["w"], torch.ones(64))


def test_load_path_is_read_with_load_storage_options(s3_backend: Backend, tmp_path: Path) -> None:
    """The Checkpointer: `load_storage_options` are the fsspec options for `load_path`."""
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as source:
        source.save(4, model={"w": torch.full((8,), 4.0)})
    target = {"w": torch.zeros(8)}
    with Checkpointer(
        str(tmp_path / "new-run"),  # local: storage_options would not reach S3
        resume=ResumeOptions(
            load_path=s3_backend.sub("iter_000000004"), load_storage_options=s3_backend.storage_options
        ),
    ) as ckpt:
        assert ckpt.load(model=target) == 0
    assert torch.equal(target["w"], torch.full((8,), 4.0))


def test_an_async_load_waits_for_the_save_in_flight(local_backend: Backend) -> None:
    """Asynchronous saves: "`load()` waits first too"."""
    with Checkpointer(local_backend.url, async_mode="async_with_pinned_mem") as ckpt:
        ckpt.save(3, trainer={"w": torch.full((1 << 20,), 3.0)})
        target = {"w": torch.zeros(1 << 20)}
        assert ckpt.load(trainer=target) == 3
        assert torch.equal(target["w"], torch.full((1 << 20,), 3.0))


def test_async_saves_with_verify_before_commit_and_retention_commit_and_prune(local_backend: Backend) -> None:
    """Asynchronous saves run the same pipeline: verify_before_commit and keep_last_n included."""
    with Checkpointer(
        local_backend.url, async_mode="async_with_pinned_mem", verify_before_commit=True, keep_last_n=2
    ) as ckpt:
        for iteration in (1, 2, 3):
            ckpt.save(iteration, trainer={"w": torch.full((16,), float(iteration))})
        ckpt.wait()
        assert ckpt.committed_iterations() == [2, 3]
    assert not (Path(local_backend.url) / "iter_000000001").exists()
