"""Crash safety: a save killed at any step leaves a loadable checkpoint, and the next one cleans up.

Each case forks a real child process that trains, saves and SIGKILLs itself at one chosen step
of the save (a function of the library is wrapped in the child to kill it there: no timing).
Then a fresh Checkpointer, as after a restart, must find the pointer on a complete checkpoint
that loads bit-exact, and its next save must succeed and leave no trace of the half-written one
(no temporary files, no uncommitted folders, no pending multipart uploads).
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing
import os
import posixpath
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pytest
import torch

from dcp_fsspec import Checkpointer
from dcp_fsspec.checkpoint import commit
from tests.ckpt_helpers import Training, assert_equal, assert_same_training
from tests.conftest import Backend

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"), pytest.mark.timeout(300)]

KEEP_LAST_N = 2
# Big enough for a multipart upload of three parts (the writer's parts are 16 MiB).
BLOB_ELEMENTS = 10 * 1024 * 1024


def _is_recursive_rm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return args[1] == "rm" and bool(kwargs.get("recursive"))


def _delete_one_key_first(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Retention half done: one key of the old iteration deleted, the rest still there."""
    root, _, folder = args[:3]
    root.fs.rm(posixpath.join(folder, "model"), recursive=True)


@dataclass(frozen=True)
class KillPoint:
    """Where the child kills itself: before the ``nth`` matching call of ``target``."""

    target: str | dict[str, str]  # "module:attribute.path", or one per backend
    nth: int = 1
    when: Callable[[tuple[Any, ...], dict[str, Any]], bool] = lambda args, kwargs: True
    first: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None  # work done before dying
    pointer_after: int = 2  # what the pointer names after the kill
    backends: tuple[str, ...] = ("local", "s3")
    blob: bool = False  # also save a key large enough for a multipart upload
    extra: dict[str, Any] = field(default_factory=dict)

    def target_for(self, backend: str) -> str:
        return self.target[backend] if isinstance(self.target, dict) else self.target


KILL_POINTS = {
    "a data file is half uploaded": KillPoint(
        {"local": "dcp_fsspec.storage.uploads:LocalUpload.commit", "s3": "dcp_fsspec.storage.uploads:S3MultipartUpload._send_part"},
        nth=2,
        blob=True,
    ),
    "data files are written but not the key's .metadata": KillPoint("dcp_fsspec.storage.writer:FsspecStorageWriter.finish"),
    "some keys are finished and others not": KillPoint("dcp_fsspec.storage.writer:FsspecStorageWriter.finish", nth=3),
    "every key is finished but the commit record is not written": KillPoint("dcp_fsspec.checkpoint.commit:commit_iteration"),
    "the commit record is written but the pointer has not moved": KillPoint("dcp_fsspec.checkpoint.commit:write_pointer"),
    "the new pointer is written under a temporary name": KillPoint(
        "os:replace", when=lambda args, kwargs: str(args[1]).endswith(commit.POINTER_NAME), backends=("local",)
    ),
    "the pointer has moved but retention has not run": KillPoint(
        "dcp_fsspec.checkpoint.retention:apply_retention", pointer_after=3
    ),
    "retention uncommitted an old iteration but did not delete it": KillPoint(
        "dcp_fsspec.checkpoint.commit:_call", when=_is_recursive_rm, pointer_after=3
    ),
    "retention deleted part of an old iteration": KillPoint(
        "dcp_fsspec.checkpoint.commit:_call", when=_is_recursive_rm, first=_delete_one_key_first, pointer_after=3
    ),
}


def _keys(training: Training, blob: bool) -> dict[str, Any]:
    keys = training.keys()
    if blob:
        step = training.trainer["step"]
        keys["blob"] = {"w": torch.arange(BLOB_ELEMENTS, dtype=torch.float32) + step}
    return keys


def _trained(steps: int) -> Training:
    training = Training()
    training.run(steps)
    return training


def _arm(point: KillPoint, backend: str) -> None:
    """In the child: wrap the target so that its nth matching call kills this process."""
    module_name, attribute = point.target_for(backend).split(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = attribute.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, name)
    matching = itertools.count(1)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if point.when(args, kwargs) and next(matching) == point.nth:
            if point.first is not None:
                point.first(args, kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _save_and_die(backend: Backend, point: KillPoint) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's thread pool
    _arm(point, backend.name)
    training = _trained(3)
    with Checkpointer(backend.url, backend.storage_options, keep_last_n=KEEP_LAST_N) as ckpt:
        ckpt.save(3, **_keys(training, point.blob))
    os._exit(0)  # the kill point was never reached: the parent reports it


def _files(backend: Backend) -> list[str]:
    fs, root = fsspec.core.url_to_fs(backend.url, **backend.storage_options)
    fs.invalidate_cache()
    return sorted(posixpath.relpath(p, root) for p in fs.find(root))


def _pending_uploads(backend: Backend) -> list[str]:
    if backend.name != "s3":
        return []
    fs, root = fsspec.core.url_to_fs(backend.url, **backend.storage_options)
    bucket = root.split("/", 1)[0]
    return [u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])]


@pytest.fixture(params=["local", "s3"])
def crash_backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.mark.parametrize("moment", list(KILL_POINTS))
def test_a_save_killed_when_leaves_the_last_checkpoint_loadable_and_the_next_save_cleans_up(
    crash_backend: Backend, moment: str
) -> None:
    point = KILL_POINTS[moment]
    if crash_backend.name not in point.backends:
        pytest.skip(f"no such moment on {crash_backend.name}")
    training = Training()
    with Checkpointer(crash_backend.url, crash_backend.storage_options, keep_last_n=KEEP_LAST_N) as ckpt:
        for iteration in (1, 2):
            training.run(1)
            ckpt.save(iteration, **_keys(training, point.blob))

    child = multiprocessing.get_context("fork").Process(target=_save_and_die, args=(crash_backend, point))
    child.start()
    child.join(timeout=240)
    assert child.exitcode == -signal.SIGKILL, f"the child was not killed at {moment!r} (exit code {child.exitcode})"

    # A restart: the pointer names a complete checkpoint, which loads bit-exact.
    resumed = Training(seed=9)
    with Checkpointer(crash_backend.url, crash_backend.storage_options, keep_last_n=KEEP_LAST_N) as ckpt:
        assert ckpt.latest_checkpoint() == f"iter_{point.pointer_after:09d}"
        assert ckpt.load(**resumed.keys()) == point.pointer_after
        resumed.after_load()
        assert_same_training(resumed, _trained(point.pointer_after))

        # The next save succeeds and leaves only committed iterations behind.
        following = point.pointer_after + 1
        resumed.run(1)
        ckpt.save(following, **_keys(resumed, point.blob))
        assert ckpt.committed_iterations() == [following - 1, following]
    files = _files(crash_backend)
    assert [f for f in files if not f.startswith(tuple(f"iter_{i:09d}/" for i in (following - 1, following)))] == [
        commit.POINTER_NAME
    ], files
    assert not [f for f in files if ".tmp" in f], files
    assert _pending_uploads(crash_backend) == []

    final = Training(seed=11)
    target = _keys(final, point.blob)
    with Checkpointer(crash_backend.url, crash_backend.storage_options) as ckpt:
        assert ckpt.load(**target) == following
    final.after_load()
    assert_same_training(final, _trained(following))
    if point.blob:
        assert_equal(target["blob"], _keys(_trained(following), True)["blob"])
