"""torch_checkpointing's own storage tests, ported, run against every ``Storage`` we compare.

Their suite (``tests/test_local_filesystem.py`` in meta-pytorch/torch_checkpointing) walks one
local folder through mkdir, write, stream_write, ls, rename, delete and rmdir, and checks that a
write into a missing folder fails. Each step is one test here, run against our FsspecStorage on
local disk, memory:// and moto S3, and against their LocalFileSystemStorage, so the two are seen
to behave the same. The rename table of ``Storage.rename`` is checked row by row the same way.
Where we differ on purpose, a test says so.
"""

from __future__ import annotations

import array
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import import_or_skip

import_or_skip(
    "torch_checkpointing",
    "the [torch-checkpointing] extra is not installed: pip install 'dcp-fsspec[torch-checkpointing]'",
)

from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

from dcp_fsspec.errors import CheckpointNotFoundError
from dcp_fsspec.integrations.torch_checkpointing import FsspecStorageConfig
from tests.conftest import Backend

# The pieces their suite writes: every kind of buffer their writer hands a stream.
PIECES: list[object] = [
    b"Hello bytes! ",
    bytearray(b"Hello bytearray! "),
    np.array([1, 2, 3, 4, 5], dtype=np.int32),
    torch.tensor([10, 20, 30, 40, 50], dtype=torch.int32).numpy(),
    array.array("i", [100, 200, 300, 400, 500]),
]
CONTENT = b"".join(memoryview(p).cast("B").tobytes() for p in PIECES)  # type: ignore[arg-type]


@dataclass
class Store:
    """A ``Storage`` under test and where its test folder is."""

    name: str
    storage: Storage
    root: Path
    # Object stores (and memory://, through our backends) keep no empty folders: a folder is
    # there while a file is below it.
    keeps_empty_folders: bool
    # What its messages call the root.
    url: str

    def at(self, relative: str) -> Path:
        return self.root / relative


@pytest.fixture(params=["ours-local", "ours-memory", "ours-s3", "theirs-local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "theirs-local":
        theirs = LocalFileSystemStorageConfig(use_direct_io=False).create_storage()
        (tmp_path / "theirs").mkdir()
        return Store(
            request.param, theirs, tmp_path / "theirs", keeps_empty_folders=True, url=str(tmp_path / "theirs")
        )
    backend: Backend = request.getfixturevalue(f"{request.param.removeprefix('ours-')}_backend")
    storage = FsspecStorageConfig(url=backend.url, storage_options=backend.storage_options).create_storage()
    storage.mkdir(Path(""))
    return Store(
        request.param, storage, Path(""), keeps_empty_folders=backend.name == "local", url=backend.url
    )


def _stream_write(store: Store, relative: str) -> None:
    with store.storage.stream_write(store.at(relative)) as stream:
        for piece in PIECES:
            stream.write(piece)


def _tree(store: Store) -> None:
    """Their suite's tree: ``dir_level1/write_output.bin`` and ``dir_level1/dir_level2/stream_write_output.bin``."""
    store.storage.mkdir(store.at("dir_level1"), recursive=True)
    store.storage.mkdir(store.at("dir_level1/dir_level2"), recursive=True)
    store.storage.write(store.at("dir_level1/write_output.bin"), CONTENT)
    _stream_write(store, "dir_level1/dir_level2/stream_write_output.bin")


def test_write_and_stream_write_take_every_buffer_kind_and_read_back_the_same_bytes(store: Store) -> None:
    _tree(store)
    for relative in ("dir_level1/write_output.bin", "dir_level1/dir_level2/stream_write_output.bin"):
        assert store.storage.read(store.at(relative)) == CONTENT
        assert store.storage.getsize(store.at(relative)) == len(CONTENT)


def test_ls_names_the_files_and_folders_of_each_level(store: Store) -> None:
    _tree(store)
    assert sorted(store.storage.ls(store.root)) == ["dir_level1"]
    assert sorted(store.storage.ls(store.at("dir_level1"))) == ["dir_level2", "write_output.bin"]
    assert sorted(store.storage.ls(store.at("dir_level1/dir_level2"))) == ["stream_write_output.bin"]
    assert store.storage.isdir(store.at("dir_level1/dir_level2"))
    assert not store.storage.isdir(store.at("dir_level1/write_output.bin"))


def test_a_file_rename_moves_the_file_and_ls_shows_the_new_name(store: Store) -> None:
    _tree(store)
    old, new = (
        store.at("dir_level1/dir_level2/stream_write_output.bin"),
        store.at("dir_level1/dir_level2/renamed.bin"),
    )
    store.storage.rename(old, new)
    assert not store.storage.exists(old) and store.storage.read(new) == CONTENT
    assert sorted(store.storage.ls(store.at("dir_level1/dir_level2"))) == ["renamed.bin"]


def test_delete_removes_each_file(store: Store) -> None:
    _tree(store)
    store.storage.delete(store.at("dir_level1/write_output.bin"))
    store.storage.delete(store.at("dir_level1/dir_level2/stream_write_output.bin"))
    assert not store.storage.exists(store.at("dir_level1/write_output.bin"))
    assert not store.storage.exists(store.at("dir_level1/dir_level2/stream_write_output.bin"))


def test_a_folder_emptied_by_delete_is_kept_where_folders_are_real(store: Store) -> None:
    if not store.keeps_empty_folders:
        pytest.skip("an object store keeps no empty folders: see the test below")
    _tree(store)
    store.storage.delete(store.at("dir_level1/write_output.bin"))
    store.storage.delete(store.at("dir_level1/dir_level2/stream_write_output.bin"))
    assert sorted(store.storage.ls(store.at("dir_level1"))) == ["dir_level2"]
    assert store.storage.ls(store.at("dir_level1/dir_level2")) == []


def test_on_an_object_store_a_folder_emptied_by_delete_is_gone_and_ls_of_it_is_not_found_naming_it(
    store: Store,
) -> None:
    # On purpose: S3 has no folders, only keys. Their suite expects ls of an emptied folder to be [].
    if store.keeps_empty_folders:
        pytest.skip("folders are real here: see the test above")
    _tree(store)
    store.storage.delete(store.at("dir_level1/write_output.bin"))
    store.storage.delete(store.at("dir_level1/dir_level2/stream_write_output.bin"))
    assert not store.storage.exists(store.at("dir_level1"))
    with pytest.raises(CheckpointNotFoundError, match=re.escape(f"{store.url}/dir_level1/dir_level2")):
        store.storage.ls(store.at("dir_level1/dir_level2"))


def test_rmdir_removes_the_whole_tree_and_leaves_an_empty_root(store: Store) -> None:
    # On an object store the root is then gone too; our ls calls it empty, as their local one does.
    _tree(store)
    store.storage.rmdir(store.at("dir_level1"))
    assert not store.storage.exists(store.at("dir_level1"))
    assert not store.storage.exists(store.at("dir_level1/dir_level2/stream_write_output.bin"))
    assert store.storage.ls(store.root) == []


def test_their_write_into_a_missing_folder_fails_and_leaves_no_file(tmp_path: Path) -> None:
    storage = LocalFileSystemStorageConfig(use_direct_io=False).create_storage()
    target = tmp_path / "nonexistent_dir" / "test_file.bin"
    with pytest.raises(RuntimeError, match="nonexistent_dir"):
        storage.write(target, b"test data")
    with pytest.raises(RuntimeError, match="nonexistent_dir"), storage.stream_write(target) as stream:
        stream.write(b"test data")
    assert not target.exists()


def test_our_write_into_a_missing_folder_makes_the_folder(store: Store) -> None:
    # On purpose: object stores have no folders to make first, so neither write insists on one.
    # Their writer makes every folder before it writes, so it sees no difference.
    if store.name == "theirs-local":
        pytest.skip("theirs refuses: see the test above")
    store.storage.write(store.at("nonexistent_dir/test_file.bin"), b"test data")
    _stream_write(store, "other_dir/streamed.bin")
    assert store.storage.read(store.at("nonexistent_dir/test_file.bin")) == b"test data"
    assert store.storage.read(store.at("other_dir/streamed.bin")) == CONTENT


# --- the rename table of Storage.rename ---------------------------------------------------------


def _make(store: Store, relative: str, kind: str) -> None:
    """Put a ``kind`` at ``relative``: "absent", "file", "empty folder" or "full folder"."""
    if kind == "file":
        store.storage.write(store.at(relative), relative.encode())
    elif kind == "empty folder":
        store.storage.mkdir(store.at(relative))
    elif kind == "full folder":
        store.storage.mkdir(store.at(relative))  # theirs writes only into a folder that exists
        store.storage.write(store.at(f"{relative}/model_0.pt"), relative.encode())


@pytest.mark.parametrize(
    ("source", "destination"),
    [("full folder", "absent"), ("full folder", "empty folder"), ("file", "absent"), ("file", "file")],
)
def test_a_rename_onto_free_space_commits_the_source_at_the_destination(
    store: Store, source: str, destination: str
) -> None:
    if destination == "empty folder" and not store.keeps_empty_folders:
        pytest.skip("an object store has no empty folder to rename onto")
    _make(store, "src", source)
    _make(store, "dst", destination)
    store.storage.rename(store.at("src"), store.at("dst"), is_directory=source != "file")
    assert not store.storage.exists(store.at("src"))
    if source == "file":
        assert store.storage.read(store.at("dst")) == b"src"
    else:  # the contents land at dst itself, not at dst/src
        assert sorted(store.storage.ls(store.at("dst"))) == ["model_0.pt"]
        assert store.storage.read(store.at("dst/model_0.pt")) == b"src"


@pytest.mark.parametrize(
    ("source", "destination"),
    [
        ("full folder", "full folder"),
        ("full folder", "file"),
        ("file", "full folder"),
        ("file", "empty folder"),
    ],
)
def test_a_rename_onto_occupied_space_is_refused_naming_the_destination_and_changes_nothing(
    store: Store, source: str, destination: str
) -> None:
    if destination == "empty folder" and not store.keeps_empty_folders:
        pytest.skip("an object store has no empty folder to rename onto")
    _make(store, "src", source)
    _make(store, "dst", destination)
    with pytest.raises(FileExistsError, match=re.escape(f"{store.url}/dst")):
        store.storage.rename(store.at("src"), store.at("dst"), is_directory=source != "file")
    assert store.storage.exists(store.at("src"))
    if destination != "empty folder":
        wanted = "dst/model_0.pt" if destination == "full folder" else "dst"
        assert store.storage.read(store.at(wanted)) == b"dst"
