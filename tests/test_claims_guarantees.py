"""Rows of the README's guarantees table that no other test checked on every backend it promises.

Each test names its row in its docstring (the rule in ``test_readme_claims.py`` holds the table
to that).
"""

from __future__ import annotations

import posixpath
from typing import Any

import pytest
import torch

from dcp_fsspec import CheckpointNotFoundError, FsspecStorageReader, FsspecStorageWriter
from dcp_fsspec.checkpoint.commit import pointer
from dcp_fsspec.storage.format import names
from dcp_fsspec.storage.transport.urls import resolve
from tests.conftest import Backend
from tests.helpers import raises_through_dcp, save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _DiedBeforeCommitting(Exception):
    """Stands for whatever ends a save between its data files and its ``.metadata``."""


def test_an_overwrite_that_dies_before_its_commit_point_leaves_no_metadata_old_or_new(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old ``.metadata`` is gone before any new data is written, and the new one is written
    only after all of it: a save that died in between is never loaded, as the old nor the new.

    Guarantee row: 'overwriting first removes the old .metadata' (local, memory, S3, GCS, Azure, SFTP)
    Guarantee row: '.metadata (the commit point) is written last, by one rank, after every rank's data' (local, memory, S3, GCS, Azure, SFTP)
    Guarantee row: 'a save that dies part-way leaves no .metadata (so it is never loaded as a checkpoint)' (local, memory, S3, GCS, Azure, SFTP)
    """
    save({"w": torch.ones(3)}, backend)
    seen_at_finish: list[list[str]] = []

    def die(self: FsspecStorageWriter, *args: Any, **kwargs: Any) -> None:
        seen_at_finish.append(
            sorted(
                posixpath.basename(p)
                for p in backend.fs.find(resolve(backend.url, backend.storage_options).path)
            )
        )
        raise _DiedBeforeCommitting()

    monkeypatch.setattr(FsspecStorageWriter, "finish", die)
    with raises_through_dcp(_DiedBeforeCommitting):
        save({"w": torch.full((3,), 7.0)}, backend, overwrite=True)
    monkeypatch.undo()
    # When the commit point came, every data file was there and no .metadata, old or new.
    (files,) = seen_at_finish
    assert names.METADATA_NAME not in files and any(f.endswith(".distcp") for f in files), files
    backend.fs.invalidate_cache()
    with pytest.raises(CheckpointNotFoundError) as raised:
        FsspecStorageReader(backend.url, storage_options=backend.storage_options).read_metadata()
    assert backend.url in str(raised.value)


@pytest.mark.parametrize("backend_name", ["memory", "s3", "gcs", "azure"])
def test_the_pointer_is_one_whole_write_on_stores_without_rename(
    backend_name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guarantee row: 'the pointer latest_checkpoint.txt is replaced atomically' (memory, S3, GCS, Azure)"""
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    root = resolve(backend.url, backend.storage_options)
    pointer.write_pointer(root, 3)
    writes: list[tuple[str, bytes]] = []
    if backend_name == "memory":  # its backend puts a whole MemoryFile into the store
        from fsspec.implementations.memory import MemoryFile

        real_commit = MemoryFile.commit

        def commit(file: MemoryFile) -> None:
            writes.append((file.path, file.getvalue()))
            real_commit(file)

        monkeypatch.setattr(MemoryFile, "commit", commit)
    else:
        real_pipe_file = root.fs.pipe_file

        def spy(path: str, value: bytes, **kwargs: Any) -> Any:
            writes.append((path, value))
            return real_pipe_file(path, value, **kwargs)

        monkeypatch.setattr(root.fs, "pipe_file", spy)
    monkeypatch.setattr(root.fs, "open", lambda *a, **k: pytest.fail("the pointer must not be streamed"))
    monkeypatch.setattr(
        root.fs, "mv", lambda *a, **k: pytest.fail("no rename: the store has none that is atomic")
    )
    assert pointer.write_pointer(root, 7)
    assert writes == [(root.join(names.POINTER_NAME), b"iter_000000007\n")]
    assert pointer.read_pointer(root) == 7
