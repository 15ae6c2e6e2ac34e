"""A data file is complete or absent, on the backends ``test_crash_safety.py`` does not kill on.

A real child process (forked) saves one tensor large enough for several upload blocks and
SIGKILLs itself part-way through the data file's upload, at a chosen call of the driver (no
timing): after an upload block went up on GCS and Azure, after every byte went to the temporary
name on SFTP. The file's final name must then not exist: no reader can ever see a partial data
file. ``memory://`` dies with its process, so there a save that fails part-way stands for the
crash (see the last test).
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing
import os
import posixpath
import signal
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import FsspecStorageWriter, StorageError, WriterSettings
from dcp_fsspec.storage.format import names
from tests.conftest import Backend
from tests.helpers import raises_through_dcp

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),
]

MiB = 1024 * 1024
# The smallest part the writer takes (5 MiB); the tensor spans three of them.
PART = 5 * MiB
ELEMENTS = 3 * PART // 4

# Where the child dies: before the nth call of this function of the driver or of ours.
KILL_AT = {
    "gcs": ("gcsfs.core:GCSFile._upload_chunk", 2),  # the first block is in the resumable upload
    "azure": ("adlfs.spec:AzureBlobFile._upload_chunk", 2),  # the first block is staged
    "sftp": ("dcp_fsspec.storage.backends.sftp:RenameUpload.commit", 1),  # all bytes under the temporary name
}


def _kill_at(target: str, nth: int) -> None:
    """In the child: wrap ``target`` ("module:Class.method") so that its nth call kills the process."""
    module_name, attribute = target.split(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = attribute.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, name)
    calls = itertools.count(1)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _save_and_die(backend: Backend) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's thread pool
    _kill_at(*KILL_AT[backend.name])
    writer = FsspecStorageWriter(
        backend.url,
        storage_options=backend.storage_options,
        settings=WriterSettings(part_size=PART, files_per_rank=1),
    )
    dcp.save({"w": torch.arange(ELEMENTS, dtype=torch.float32)}, storage_writer=writer, no_dist=True)
    os._exit(0)  # the kill point was never reached: the parent reports it


def _files(backend: Backend) -> list[str]:
    fs = backend.fs
    fs.invalidate_cache()
    root = fs._strip_protocol(backend.url)
    return sorted(posixpath.relpath(p, root) for p in fs.find(root))


@pytest.mark.parametrize("backend_name", sorted(KILL_AT))
def test_a_save_killed_while_uploading_a_data_file_leaves_no_file_under_its_name(
    backend_name: str, request: pytest.FixtureRequest
) -> None:
    """Guarantee row: 'a data file is complete or absent' (GCS, Azure, SFTP)"""
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    child = multiprocessing.get_context("fork").Process(target=_save_and_die, args=(backend,))
    child.start()
    child.join(timeout=240)
    assert child.exitcode == -signal.SIGKILL, (
        f"the child was not killed mid-upload (exit code {child.exitcode})"
    )
    files = _files(backend)
    assert not [f for f in files if f.endswith(".distcp") or f == names.METADATA_NAME], files
    if backend_name == "sftp":  # the bytes went somewhere: under the temporary name only
        assert [f for f in files if ".tmp" in f], files


class _DiskFull(OSError):
    """Stands for whatever ends a write part-way in one process."""


def test_a_memory_save_that_fails_part_way_through_a_data_file_leaves_no_file_under_its_name(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memory:// lives and dies with its process, so a crash leaves nothing to look at; a save
    that fails part-way through a data file must leave the file complete or absent.

    Guarantee row: 'a data file is complete or absent' (memory)
    """
    from fsspec.implementations.memory import MemoryFile

    real_write = MemoryFile.write
    calls = itertools.count(1)

    def write_then_fail(self: MemoryFile, data: Any) -> int:
        if next(calls) == 2:
            raise _DiskFull("no space left")
        return real_write(self, data)

    monkeypatch.setattr(MemoryFile, "write", write_then_fail)
    writer = FsspecStorageWriter(
        memory_backend.url, settings=WriterSettings(part_size=PART, files_per_rank=1)
    )
    with raises_through_dcp(StorageError) as raised:
        dcp.save({"w": torch.arange(ELEMENTS, dtype=torch.float32)}, storage_writer=writer, no_dist=True)
    monkeypatch.undo()
    assert isinstance(raised.value.__cause__, _DiskFull), raised.value
    files = _files(memory_backend)
    assert not [f for f in files if f.endswith(".distcp")], files
