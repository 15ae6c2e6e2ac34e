"""Paths read from storage stay inside their folder: ``.metadata``'s data files, the pointer, ``cp``'s keys.

Each test plants a real file where the escaping path leads, so that following the path would
succeed quietly; what must happen instead is an error naming the path, before a byte of it is
read or written.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_fsspec import Checkpointer, CorruptCheckpointError, FsspecStorageReader, cli
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.checkpoint_files.integrity import verify_checkpoint
from dcp_fsspec.tools.transfer import copy_checkpoint
from tests.conftest import Backend
from tests.helpers import save
from tests.security.crafted import edit_metadata, fs_path, load_failure, storage_entry

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _point_entry_at(relative_path: str) -> Any:
    def edit(metadata: Any) -> None:
        storage_entry(metadata, "w").relative_path = relative_path

    return edit


# -- .metadata ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "relative_path",
    [
        "../elsewhere/__0_0.distcp",
        "sub/../../elsewhere/__0_0.distcp",
        "{abs}",
        "file://{abs}",
        "..\\elsewhere\\__0_0.distcp",
    ],
    ids=["dot-dot", "dot-dot-inside", "absolute", "scheme", "backslash"],
)
def test_metadata_naming_a_data_file_outside_the_checkpoint_is_refused_before_reading(
    tmp_path: Path, relative_path: str
) -> None:
    backend = Backend("local", str(tmp_path / "ckpt"))
    save({"w": torch.arange(4.0)}, backend)
    # The file the path leads to exists and holds a valid record: following it would load.
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "ckpt" / "__0_0.distcp", tmp_path / "elsewhere" / "__0_0.distcp")
    relative_path = relative_path.format(abs=tmp_path / "elsewhere" / "__0_0.distcp")
    url = edit_metadata(backend, backend.url, _point_entry_at(relative_path))
    error = load_failure({"w": torch.zeros(4)}, backend)
    message = str(error)
    assert (
        isinstance(error, CorruptCheckpointError)
        and url in message
        and repr(relative_path) in message
        and "'w'" in message
        and "outside" in message
    )
    report = verify_checkpoint(backend.url)
    assert [p.url for p in report.problems] == [url] and repr(relative_path) in report.problems[0].what


def test_metadata_naming_a_file_in_another_bucket_is_refused(
    s3_backend: Backend, s3_server: LocalS3Server
) -> None:
    save({"w": torch.arange(4.0)}, s3_backend)
    other = f"other-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(other)
    fs, path = fs_path(s3_backend, s3_backend.sub("__0_0.distcp"))
    fs.pipe_file(f"{other}/__0_0.distcp", fs.cat_file(path))  # a valid record, in the other bucket
    for relative_path in (f"/{other}/__0_0.distcp", f"s3://{other}/__0_0.distcp"):
        url = edit_metadata(s3_backend, s3_backend.url, _point_entry_at(relative_path))
        with pytest.raises(CorruptCheckpointError) as info:
            FsspecStorageReader(s3_backend.url, storage_options=s3_backend.storage_options).read_metadata()
        assert url in str(info.value) and repr(relative_path) in str(info.value)


# -- the pointer ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pointer", ["../iter_000000001", "iter_000000001/../../x", "/etc/iter_000000001", "s3://b/iter_000000001"]
)
def test_a_pointer_naming_anything_but_an_iteration_folder_is_refused(
    memory_backend: Backend, pointer: str
) -> None:
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, w={"t": torch.ones(2)})
    fs, path = fs_path(memory_backend, memory_backend.sub("latest_checkpoint.txt"))
    fs.pipe_file(path, pointer.encode())
    with (
        Checkpointer(memory_backend.url) as ckpt,
        pytest.raises(CorruptCheckpointError, match="latest_checkpoint.txt"),
    ):
        ckpt.load(w={"t": torch.zeros(2)})


# -- cp ------------------------------------------------------------------------------------------------


def _files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_cp_refuses_an_s3_key_with_dot_dot_and_writes_nothing(
    s3_backend: Backend, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        ckpt.save(1, model={"w": torch.ones(3)})
    fs, root = fs_path(s3_backend, s3_backend.url)
    evil = f"{root}/iter_000000001/model/../../../escaped.txt"
    fs.pipe_file(evil, b"import os  # a .pth file in site-packages would run this")
    fs.invalidate_cache()
    assert evil in fs.find(root), "the store normalized the key; the test would prove nothing"
    dest = tmp_path / "dest" / "copy"
    with pytest.raises(CorruptCheckpointError) as info:
        copy_checkpoint(s3_backend.url, str(dest), s3_backend.storage_options)
    assert "escaped.txt" in str(info.value) and "'..'" in str(info.value)
    assert _files_under(tmp_path) == [], "cp wrote something"
    code = cli.main(
        ["cp", s3_backend.url, str(dest), "--storage-options", json.dumps(s3_backend.storage_options)]
    )
    assert code == 1 and "escaped.txt" in capsys.readouterr().err
    assert _files_under(tmp_path) == []


@pytest.mark.parametrize("link", ["file", "folder"])
def test_cp_refuses_a_symlink_out_of_a_local_source(tmp_path: Path, link: str) -> None:
    source = tmp_path / "run"
    with Checkpointer(source) as ckpt:
        ckpt.save(1, model={"w": torch.ones(3)})
    secret = tmp_path / "private"
    secret.mkdir()
    (secret / "id_rsa").write_text("secret")
    model = source / "iter_000000001" / "model"
    if link == "file":
        name = next(p.name for p in model.iterdir() if p.suffix == ".distcp")
        os.replace(model / name, tmp_path / "moved.distcp")
        os.symlink(secret / "id_rsa", model / name)
    else:
        name = "keys"
        os.symlink(secret, model / name)
    dest = tmp_path / "dest"
    with pytest.raises(CorruptCheckpointError) as info:
        copy_checkpoint(str(source), str(dest))
    assert str(model / name) in str(info.value) and str(secret) in str(info.value)
    assert not dest.exists()


def test_cp_copies_a_symlink_that_stays_inside_the_source(tmp_path: Path) -> None:
    source = tmp_path / "run"
    with Checkpointer(source) as ckpt:
        ckpt.save(1, model={"w": torch.ones(3)})
    model = source / "iter_000000001" / "model"
    name = next(p.name for p in model.iterdir() if p.suffix == ".distcp")
    os.replace(model / name, source / "shared.distcp")
    os.symlink(source / "shared.distcp", model / name)
    copy_checkpoint(str(source), str(tmp_path / "dest"))
    target = {"w": torch.zeros(3)}
    with Checkpointer(tmp_path / "dest") as ckpt:
        assert ckpt.load(model=target) == 1
    assert torch.equal(target["w"], torch.ones(3))
