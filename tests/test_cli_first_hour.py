"""What a new user meets in the ``dcp-fsspec`` command line's first hour.

A checkpoint's own file given for its folder (``.metadata``, the pointer, a commit record), a
copy to S3 whose options went to the local source, a bucket that does not exist, and
``verify``'s count of items without a checksum. Each is run as users run the command line,
``cli.main([...])``, on real storage: memory://, local disk and a moto S3 server.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import FsspecStorageWriter, StorageError, cli, verify
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.tools import _cli
from dcp_fsspec.tools.listing import list_run
from tests.conftest import Backend
from tests.test_cli_errors import no_credentials  # noqa: F401 - the fixture, shared
from tests.test_verify import _run
from dcp_fsspec import WriterSettings

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


# -- a checkpoint's own file, given for its folder ------------------------------------------------


def test_inspect_of_a_metadata_file_shows_the_checkpoint_that_holds_it(
    capsys: pytest.CaptureFixture[str], local_backend: Backend
) -> None:
    _run(local_backend, [1])
    model = local_backend.sub("iter_000000001", "model")
    code, out, err = _cli_run(capsys, "inspect", f"{model}/.metadata")
    assert code == 0, err
    assert out.splitlines()[0] == model
    assert any(line.startswith("0.weight ") for line in out.splitlines())


def test_inspect_and_ls_of_the_pointer_file_show_its_save_dirname(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1, 2])
    pointer = memory_backend.sub("latest_checkpoint.txt")
    code, out, err = _cli_run(capsys, "inspect", pointer)
    assert code == 0, err
    assert out.splitlines()[0] == f"{memory_backend.sub('iter_000000002')}  (iteration 2)"
    code, out, err = _cli_run(capsys, "ls", pointer)
    assert code == 0, err
    assert out.splitlines()[0] == memory_backend.url
    assert [line.split()[0] for line in out.splitlines() if line.startswith("iter_")] == ["iter_000000001", "iter_000000002"]


def test_prune_of_the_pointer_file_prunes_its_save_dirname(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend
) -> None:
    _run(memory_backend, [1, 2])
    code, out, err = _cli_run(capsys, "prune", memory_backend.sub("latest_checkpoint.txt"), "--keep", "1", "--dry-run")
    assert code == 0, err
    assert "would delete iter_000000001" in out and f"{memory_backend.url}: would keep iter_000000002" in out


def test_verify_of_a_commit_record_on_s3_verifies_its_iteration(
    capsys: pytest.CaptureFixture[str], s3_backend: Backend
) -> None:
    _run(s3_backend, [1])
    folder = s3_backend.sub("iter_000000001")
    options = json.dumps(s3_backend.storage_options)
    code, out, err = _cli_run(capsys, "verify", f"{folder}/.commit.json", "--storage-options", options)
    assert code == 0, err
    assert out.splitlines()[-1].startswith(f"OK {folder}: 1 checkpoint(s) (4 keys)")


def test_ls_of_a_metadata_file_names_the_commands_and_urls_to_give(
    capsys: pytest.CaptureFixture[str], local_backend: Backend
) -> None:
    _run(local_backend, [1])
    model = local_backend.sub("iter_000000001", "model")
    doc = _error(capsys, "ls", f"{model}/.metadata")
    assert doc["kind"] == "not_found" and doc["exit_code"] == _cli.EXIT_NOT_FOUND
    assert f"`dcp-fsspec inspect {model}`" in str(doc["error"])
    assert f"`dcp-fsspec ls {local_backend.url}`" in str(doc["error"])


def test_a_file_that_is_not_a_checkpoints_own_is_refused_as_a_file_naming_it(
    capsys: pytest.CaptureFixture[str], local_backend: Backend
) -> None:
    _run(local_backend, [1])
    notes = Path(local_backend.url, "notes.txt")
    notes.write_text("lr 1e-3\n")
    code, _, err = _cli_run(capsys, "inspect", str(notes))
    assert code == _cli.EXIT_NOT_FOUND
    assert f"dcp-fsspec inspect: error: {notes} is a file, not a checkpoint's folder: give" in err


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
    dcp.save(state, storage_writer=FsspecStorageWriter(memory_backend.url, settings=WriterSettings(checksums=False)), no_dist=True)
    code, out, err = _cli_run(capsys, "verify", memory_backend.url)
    assert code == 0, err
    assert (
        "3 without a checksum (1 non-tensor entries: pickled values, which DCP stores without one; "
        "2 tensors stored without one: empty, or saved with checksums=False)"
    ) in out
