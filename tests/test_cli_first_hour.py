"""What a new user meets in the ``dcp-fsspec`` command line's first hour.

A file given for a folder (refused by every command, naming the folder to give), a retired
iteration, ``prune``'s first call, a copy to S3 whose options went to the local source, a bucket
that does not exist, and ``verify``'s count of items without a checksum. Each is run as users run the command line,
``cli.main([...])``, on real storage: memory://, local disk and a moto S3 server.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import FsspecStorageWriter, StorageError, WriterSettings, cli, verify
from dcp_fsspec.checkpoint.commit.commit_record import read_commit_record, record_path, retired_mark
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.transport.urls import resolve
from dcp_fsspec.tools import _cli
from dcp_fsspec.tools import verify as verify_tool
from dcp_fsspec.tools.ls import list_run
from tests.conftest import Backend
from tests.test_cli_errors import no_credentials  # noqa: F401 - the fixture, shared
from tests.test_verify import _run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _cli_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code, out, _ = _cli_run(capsys, *argv, "--json")
    doc = json.loads(out)
    assert doc["exit_code"] == code
    return dict(doc)


# -- a file given for a folder: refused by every command, naming the folder to give -----------------

# Each command, with what it needs after the URL.
_COMMANDS = {
    "ls": [],
    "inspect": [],
    "verify": [],
    "cp": ["{tmp}/copy"],
    "prune": ["--keep", "1", "--dry-run"],
    "to-torch": ["{tmp}/out.pt"],
    "to-safetensors": ["{tmp}/out"],
}
# A file of a run (under its save_dirname) → the folder the error names instead.
_FILES = {
    "latest_checkpoint.txt": "",
    "iter_000000001/.commit.json": "iter_000000001",
    "iter_000000001/model/.metadata": "iter_000000001/model",
    "iter_000000001/model/__0_0.distcp": "iter_000000001/model",
}


def test_every_command_is_given_every_cli_command() -> None:
    assert set(_COMMANDS) == set(cli._COMMANDS) - {"demo"}


@pytest.mark.parametrize("command", sorted(_COMMANDS))
@pytest.mark.parametrize("file", sorted(_FILES))
def test_every_command_refuses_a_file_of_a_run_and_names_the_folder_to_give(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, file: str
) -> None:
    run = tmp_path / "run"
    _run(Backend("local", str(run)), [1])
    url, folder = str(run / file), str(run / _FILES[file]).rstrip("/")
    extra = [arg.format(tmp=tmp_path) for arg in _COMMANDS[command]]
    doc = _error(capsys, command, url, *extra)
    assert doc["kind"] == "not_found" and doc["exit_code"] == _cli.EXIT_NOT_FOUND
    assert str(doc["error"]).startswith(f"{url} is a file, not a folder: give ")
    assert f" that holds it, {folder}" in str(doc["error"])
    assert not (tmp_path / "copy").exists() and not (tmp_path / "out.pt").exists()


def test_a_file_that_is_not_a_checkpoints_own_is_refused_as_a_file_naming_it(
    capsys: pytest.CaptureFixture[str], local_backend: Backend
) -> None:
    _run(local_backend, [1])
    model = Path(local_backend.url, "model.pt")
    model.write_bytes(b"not a checkpoint")
    code, _, err = _cli_run(capsys, "inspect", str(model))
    assert code == _cli.EXIT_NOT_FOUND
    assert f"dcp-fsspec inspect: error: {model} is a file, not a folder: give a DCP checkpoint folder" in err


# -- an incremental run's retired iteration -------------------------------------------------------


def test_verify_notes_a_retired_iteration_as_retired_as_ls_shows_it(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1, 2])
    root = resolve(memory_backend.url, memory_backend.storage_options)
    record = read_commit_record(root, 1)
    assert record is not None
    root.fs.pipe_file(record_path(root, 1), retired_mark(record))
    folder = memory_backend.sub("iter_000000001")

    report = verify(memory_backend.url)
    assert report.ok and report.notes == [f"skipped {folder}: {verify_tool.RETIRED}"]
    alone = verify(folder)
    assert alone.ok and alone.notes == report.notes
    code, out, _ = _cli_run(capsys, "ls", memory_backend.url)
    assert code == 0 and any(
        line.startswith("iter_000000001") and "retired" in line for line in out.splitlines()
    )


# -- prune's help ---------------------------------------------------------------------------------


def test_prune_help_shows_a_first_call_with_keep_and_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["prune", "--help"])
    out = capsys.readouterr().out
    assert "a first call deletes nothing" in out
    assert "dcp-fsspec prune s3://bucket/run1/checkpoints --keep 3 --dry-run" in out


# -- S3: where the options went, and a bucket that does not exist --------------------------------


@pytest.mark.usefixtures("no_credentials")
def test_cp_to_s3_given_only_storage_options_says_to_pass_them_as_dst_storage_options(
    capsys: pytest.CaptureFixture[str], s3_server: LocalS3Server, local_backend: Backend
) -> None:
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    _run(local_backend, [1])
    dst = f"s3://{bucket}/copy"
    options = s3_server.storage_options()
    doc = _error(capsys, "cp", local_backend.url, dst, "--storage-options", json.dumps(options))
    assert doc["kind"] == "credentials" and doc["exit_code"] == _cli.EXIT_STORAGE
    message = str(doc["error"])
    assert f"--storage-options went to the source {local_backend.url} only" in message
    assert f"pass the options for {dst} as --dst-storage-options" in message
    assert options["secret"] not in message


def test_ls_of_a_bucket_that_does_not_exist_says_so_naming_the_url(
    capsys: pytest.CaptureFixture[str], s3_backend: Backend
) -> None:
    url = f"s3://no-such-{uuid.uuid4().hex[:12]}/run"
    doc = _error(capsys, "ls", url, "--storage-options", json.dumps(s3_backend.storage_options))
    assert doc["kind"] == "storage" and doc["exit_code"] == _cli.EXIT_STORAGE
    assert str(doc["error"]).startswith(f"cannot use {url}: its bucket does not exist")
    with pytest.raises(StorageError, match=f"cannot use {url}: its bucket does not exist"):
        list_run(url, s3_backend.storage_options)


# -- verify: what the items without a checksum are -----------------------------------------------


def test_verify_says_the_items_without_a_checksum_are_non_tensor_entries(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1])
    report = verify(memory_backend.url)
    assert report.objects == report.unchecked > 0
    code, out, err = _cli_run(capsys, "verify", memory_backend.url)
    assert code == 0, err
    assert (
        f"{report.unchecked} without a checksum ({report.objects} non-tensor entries: pickled values, "
        "which DCP stores without one)"
    ) in out


def test_verify_counts_tensors_saved_without_a_checksum_apart_from_non_tensor_entries(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    state = {"w": torch.ones(3), "b": torch.ones(2), "step": 7}
    dcp.save(
        state,
        storage_writer=FsspecStorageWriter(memory_backend.url, settings=WriterSettings(checksums=False)),
        no_dist=True,
    )
    code, out, err = _cli_run(capsys, "verify", memory_backend.url)
    assert code == 0, err
    assert (
        "3 without a checksum (1 non-tensor entries: pickled values, which DCP stores without one; "
        "2 tensors stored without one: empty, or saved with checksums=False)"
    ) in out
