"""Retention, prune and ls on an incremental run: no file a kept iteration refers to is deleted.

A LoRA-shaped state (a frozen base Linear, a small adapter, AdamW on the adapter) and a trainer
key that changes at every save. Its first iteration holds the base every later one refers to:
retention retires it (a mark in its record's place), deletes its files nobody refers to, and
deletes it whole once nothing kept refers to it. A process killed at any phase of that leaves
every kept iteration loading bit-exact, and the next pass finishes the job.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import posixpath
import signal
from typing import Any

import pytest
import torch
from torch import nn

from dcp_fsspec import Checkpointer, FsspecStorageReader
from dcp_fsspec.checkpoint.commit import retention
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, CONTENT_HASHES_NAME, METADATA_NAME
from dcp_fsspec.storage.transport.urls import resolve
from dcp_fsspec.tools.ls import list_run
from dcp_fsspec.tools.prune import prune
from tests.conftest import Backend
from tests.test_cli import _cli, _json
from tests.test_cli_startup import _command
from tests.test_crash_safety import ITERATION_FOLDER, KillPoint, _arm

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),
]

KEYS = ("model", "optim", "trainer", "ema")


class Adapted(nn.Module):
    """A frozen base Linear with a trainable rank-2 adapter beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(128, 128).requires_grad_(False)
        self.lora_a = nn.Linear(128, 2, bias=False)
        self.lora_b = nn.Linear(2, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _state(steps: int) -> dict[str, Any]:
    """The run's keys after ``steps`` seeded training steps (the same bits every time)."""
    torch.manual_seed(0)
    model = Adapted()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 128)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    ema = {"decay": torch.full((32,), 0.9**steps)}
    return {"model": model, "optim": optim, "trainer": {"step": steps, "noise": torch.randn(64)}, "ema": ema}


def _save(backend: Backend, iterations: range, **options: Any) -> None:
    with Checkpointer(backend.url, backend.storage_options, incremental=True, **options) as ckpt:
        for iteration in iterations:
            ckpt.save(iteration, **_state(iteration))


def _assert_loads(backend: Backend, iteration: int) -> None:
    """A fresh Checkpointer loads ``iteration`` bit-exact."""
    loaded, expected = _state(0), _state(iteration)
    loaded["trainer"], loaded["ema"] = {"step": 0, "noise": torch.zeros(64)}, {"decay": torch.zeros(32)}
    with Checkpointer(backend.url, backend.storage_options) as ckpt:
        assert ckpt.load(iteration, **loaded) == iteration
    for name, value in expected["model"].state_dict().items():
        assert torch.equal(loaded["model"].state_dict()[name], value), (iteration, name)
    got, want = loaded["optim"].state_dict(), expected["optim"].state_dict()
    assert got["param_groups"] == want["param_groups"]
    for param, fields in want["state"].items():
        for field, value in fields.items():
            assert torch.equal(torch.as_tensor(got["state"][param][field]), torch.as_tensor(value)), (
                iteration,
                field,
            )
    assert loaded["trainer"]["step"] == iteration and torch.equal(
        loaded["trainer"]["noise"], expected["trainer"]["noise"]
    )
    assert torch.equal(loaded["ema"]["decay"], expected["ema"]["decay"])


def _files(backend: Backend, iteration: int) -> set[str]:
    """The files of ``iteration``'s folder, relative to it."""
    fs = backend.fs
    fs.invalidate_cache()
    folder = fs._strip_protocol(backend.sub(f"iter_{iteration:09d}"))
    return {posixpath.relpath(path, folder) for path in fs.find(folder)}


def _referred(backend: Backend, iteration: int) -> set[str]:
    """The files of other iterations that ``iteration``'s keys refer to, relative to the run."""
    found = set()
    for key in KEYS:
        metadata = FsspecStorageReader(
            backend.sub(f"iter_{iteration:09d}", key), backend.storage_options
        ).read_metadata()
        found |= {
            info.relative_path[len("../../") :]
            for info in metadata.storage_data.values()
            if info.relative_path.startswith("../")
        }
    return found


def _record(backend: Backend, iteration: int) -> dict[str, Any]:
    fs = backend.fs
    fs.invalidate_cache()
    return json.loads(
        fs.cat_file(fs._strip_protocol(backend.sub(f"iter_{iteration:09d}", COMMIT_RECORD_NAME)))
    )


def _assert_retired(backend: Backend, iteration: int, referred: set[str]) -> None:
    """``iteration`` holds its retired mark, each key's .metadata and content hashes, and of its
    data files exactly those ``referred`` names."""
    assert _record(backend, iteration).get("retired") is True
    prefix = f"iter_{iteration:09d}/"
    kept = {f[len(prefix) :] for f in referred if f.startswith(prefix)}
    assert kept, referred  # it is referred to: that is why it is retired
    expected = (
        {COMMIT_RECORD_NAME} | {f"{k}/{n}" for k in KEYS for n in (METADATA_NAME, CONTENT_HASHES_NAME)} | kept
    )
    assert _files(backend, iteration) == expected
    assert (
        not {"trainer/__0_0.distcp", "ema/__0_0.distcp"} & kept
    )  # changed at every save: nobody refers to them


# -- retention --------------------------------------------------------------------------------------


def test_keep_last_n_over_five_incremental_saves_retires_the_referred_iteration_and_kept_ones_load_bit_exact(
    shared_backend: Backend,
) -> None:
    _save(shared_backend, range(1, 6), keep_last_n=2)
    with Checkpointer(shared_backend.url, shared_backend.storage_options) as ckpt:
        assert ckpt.committed_iterations() == [4, 5]
    for iteration in (4, 5):
        _assert_loads(shared_backend, iteration)
    referred = _referred(shared_backend, 4) | _referred(shared_backend, 5)
    assert {f.split("/")[0] for f in referred} == {"iter_000000001"}  # the base, written once
    _assert_retired(shared_backend, 1, referred)
    assert not shared_backend.fs.exists(shared_backend.sub("iter_000000002"))  # nobody refers to it
    assert not shared_backend.fs.exists(shared_backend.sub("iter_000000003"))


def test_a_retired_iteration_that_no_kept_iteration_refers_to_any_longer_is_deleted_whole(
    local_backend: Backend,
) -> None:
    _save(local_backend, range(1, 4), keep_last_n=2)
    assert _record(local_backend, 1).get("retired") is True
    # Full saves from here on: once the incremental ones leave the kept window, nothing refers to 1.
    with Checkpointer(local_backend.url, keep_last_n=2) as ckpt:
        for iteration in (4, 5):
            ckpt.save(iteration, **_state(iteration))
    assert sorted(os.listdir(local_backend.url)) == [
        "iter_000000004",
        "iter_000000005",
        "latest_checkpoint.txt",
    ]
    _assert_loads(local_backend, 5)


def test_retention_deletes_nothing_while_a_kept_iterations_metadata_is_unreadable(
    local_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    _save(local_backend, range(1, 4))
    damaged = os.path.join(local_backend.url, "iter_000000002", "model", METADATA_NAME)
    with open(damaged, "wb") as f:
        f.write(b"not a pickle")
    before = _files(local_backend, 1)
    with caplog.at_level(logging.WARNING, logger="dcp_fsspec"):
        assert retention.apply_retention(resolve(local_backend.url), 2) == []
    assert _files(local_backend, 1) == before and _record(local_backend, 1).get("retired") is None
    assert any("retention skipped" in r.getMessage() and damaged in r.getMessage() for r in caplog.records), (
        caplog.text
    )


# -- killed during retention ------------------------------------------------------------------------


def _thinning(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A backend's ``remove_files`` call for files of a retired iteration."""
    backend, paths = args[:2]
    parts = paths[0].split("/")
    folder = "/".join(
        parts[: next(n for n, part in enumerate(parts) if ITERATION_FOLDER.fullmatch(part)) + 1]
    )
    record = backend.read_versioned(posixpath.join(folder, COMMIT_RECORD_NAME)).data
    return record is not None and json.loads(record).get("retired") is True


def _delete_half_first(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    backend, paths = args[:2]
    assert len(paths) >= 2, paths
    backend.remove_files(sorted(paths)[: len(paths) // 2], within=kwargs["within"])


REMOVE_FILES = {
    "local": "dcp_fsspec.storage.backends.local:LocalBackend.remove_files",
    "s3": "dcp_fsspec.storage.backends.s3:S3Backend.remove_files",
}
KILLED_DURING_RETENTION = {
    "it read what kept iterations refer to but retired nothing": KillPoint(
        "dcp_fsspec.checkpoint.commit.deletion:retire_iterations"
    ),
    "it retired the iteration but deleted none of its files": KillPoint(
        REMOVE_FILES, when=_thinning, backends=("local", "s3")
    ),
    "it deleted part of the retired iteration's files": KillPoint(
        REMOVE_FILES, when=_thinning, first=_delete_half_first, backends=("local", "s3")
    ),
}


def _save_third_and_die(backend: Backend, point: KillPoint) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's thread pool
    _arm(point, backend.name)
    _save(backend, range(3, 4), keep_last_n=2)
    os._exit(0)  # the kill point was never reached: the parent reports it


@pytest.mark.parametrize(
    ("backend_name", "moment"),
    [(backend, moment) for moment, point in KILLED_DURING_RETENTION.items() for backend in point.backends],
)
def test_a_save_killed_during_retention_leaves_kept_iterations_loading_and_the_next_pass_finishes(
    backend_name: str, moment: str, request: pytest.FixtureRequest
) -> None:
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    _save(backend, range(1, 3), keep_last_n=2)
    child = multiprocessing.get_context("fork").Process(
        target=_save_third_and_die, args=(backend, KILLED_DURING_RETENTION[moment])
    )
    child.start()
    child.join(timeout=240)
    assert child.exitcode == -signal.SIGKILL, (
        f"the child was not killed when {moment} (exit code {child.exitcode})"
    )

    for iteration in (2, 3):
        _assert_loads(backend, iteration)
    _save(backend, range(4, 5), keep_last_n=2)  # the next pass
    for iteration in (3, 4):
        _assert_loads(backend, iteration)
    _assert_retired(backend, 1, _referred(backend, 3) | _referred(backend, 4))
    assert not backend.fs.exists(backend.sub("iter_000000002"))


# -- prune and ls ----------------------------------------------------------------------------------


def test_prune_on_an_incremental_run_retires_what_kept_iterations_refer_to(
    capsys: pytest.CaptureFixture[str], shared_backend: Backend
) -> None:
    _save(shared_backend, range(1, 5))
    planned = prune(shared_backend.url, 2, shared_backend.storage_options, dry_run=True)
    assert (planned.to_dict()["would_delete"], planned.to_dict()["would_retire"]) == ([2], [1])
    pruned = prune(shared_backend.url, 2, shared_backend.storage_options)
    assert (pruned.deleted, pruned.retired, pruned.kept, pruned.failed) == ([2], [1], [3, 4], {})
    for iteration in (3, 4):
        _assert_loads(shared_backend, iteration)
    _assert_retired(shared_backend, 1, _referred(shared_backend, 3) | _referred(shared_backend, 4))
    # Again: nothing more goes. The options given, not taken from the environment: an s3fs
    # instance an earlier test cached for another endpoint would otherwise be reused.
    options = json.dumps(shared_backend.storage_options)
    code, out, _ = _cli(capsys, "prune", shared_backend.url, "--keep", "2", "--storage-options", options)
    assert code == 0 and "retired iter_000000001" in out and "deleted" not in out


def test_ls_shows_a_retired_iteration_and_with_referenced_splits_own_bytes_from_referenced_ones(
    capsys: pytest.CaptureFixture[str], local_backend: Backend
) -> None:
    _save(local_backend, range(1, 6), keep_last_n=2)
    code, out, _ = _cli(capsys, "ls", local_backend.url, "--referenced")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("iter_")}
    assert list(rows) == ["iter_000000001", "iter_000000004", "iter_000000005"]
    assert "referenced" in out.splitlines()[1] and rows["iter_000000001"][1] == "retired"
    doc = _json(capsys, "ls", local_backend.url, "--referenced")
    by_iteration = {i["iteration"]: i for i in doc["iterations"]}
    assert by_iteration[1]["retired"] is True and by_iteration[1]["committed"] is False
    assert by_iteration[1]["referenced_bytes"] == 0  # the first save refers to nothing
    for iteration in (4, 5):
        info = by_iteration[iteration]
        own = sum(
            os.path.getsize(os.path.join(local_backend.url, f"iter_{iteration:09d}", f))
            for f in _files(local_backend, iteration)
        )
        refers = 0
        for key in KEYS:
            metadata = FsspecStorageReader(local_backend.sub(f"iter_{iteration:09d}", key)).read_metadata()
            refers += sum(
                i.length for i in metadata.storage_data.values() if i.relative_path.startswith("../")
            )
        assert (info["size_bytes"], info["referenced_bytes"], info["retired"]) == (own, refers, False)
        assert refers > own  # the frozen base is most of the state, and written once


def test_ls_of_an_incremental_run_stays_torch_free_and_says_how_to_see_referenced_bytes(
    tmp_path: Any, local_backend: Backend
) -> None:
    _save(local_backend, range(1, 4), keep_last_n=2)
    result = _command(tmp_path, "ls", local_backend.url)
    assert result["code"] == 0 and result["torch"] is False
    assert "retired" in str(result["out"]) and "--referenced" in str(result["out"])
    assert list_run(local_backend.url).iterations[-1].referenced_bytes is None  # not read unless asked


def test_retiring_an_iteration_whose_record_is_damaged_raises_naming_the_record(
    memory_backend: Backend,
) -> None:
    from dcp_fsspec.checkpoint.commit import deletion
    from dcp_fsspec.errors import CorruptCheckpointError

    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, model=nn.Linear(2, 2))
    root = resolve(memory_backend.url, memory_backend.storage_options)
    record = root.join("iter_000000001", COMMIT_RECORD_NAME)
    root.backend.write_small_atomic(record, b"{not json")
    with pytest.raises(
        CorruptCheckpointError, match=f"{memory_backend.url}/iter_000000001/{COMMIT_RECORD_NAME}"
    ):
        deletion.retire_iterations(root, [1])
