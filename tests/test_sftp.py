"""sftp:// (sshfs) against a real OpenSSH sshd on 127.0.0.1: what works, and what does not yet.

The server is this machine, so a checkpoint saved to a local folder is also on the SFTP server
under the same path: these tests write locally and read through sftp://. sshfs answers a ranged
``cat_file`` with the whole file, so the reader must read ranges with open/seek/read there; the
small request size below makes every record span several ranged reads.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import (
    Checkpointer,
    CheckpointNotFoundError,
    FsspecStorageReader,
    FsspecStorageWriter,
    verify,
)
from tests.ckpt_helpers import Training, assert_same_training
from tests.conftest import Backend
from tests.helpers import load, save
from tests.states import assert_state_equal, empty_like_state, sample_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _local_path(sftp_backend: Backend) -> str:
    return sftp_backend.fs._strip_protocol(sftp_backend.url)


def test_checkpoint_saved_locally_loads_bitwise_through_sftp_ranged_reads(sftp_backend: Backend) -> None:
    state = sample_state() | {"big": torch.randn(300_000, generator=torch.Generator().manual_seed(3))}
    dcp.save(state, storage_writer=FsspecStorageWriter(_local_path(sftp_backend)), no_dist=True)
    loaded = load(empty_like_state(state), sftp_backend, max_request_bytes=64 * 1024, window_bytes=256 * 1024)
    assert_state_equal(loaded, state)


def test_checkpointer_resumes_through_sftp(sftp_backend: Backend) -> None:
    saved = Training()
    with Checkpointer(_local_path(sftp_backend)) as ckpt:
        saved.run(2)
        ckpt.save(2, **saved.keys())
    resumed = Training(seed=5)
    with Checkpointer(sftp_backend.url, sftp_backend.storage_options) as ckpt:
        assert ckpt.load(**resumed.keys()) == 2
        resumed.after_load()
    assert_same_training(resumed, saved)


def test_verify_reads_every_record_through_sftp(sftp_backend: Backend) -> None:
    dcp.save(sample_state(), storage_writer=FsspecStorageWriter(_local_path(sftp_backend)), no_dist=True)
    report = verify(sftp_backend.url, sftp_backend.storage_options, max_request_bytes=4096)
    assert report.ok, report.problems
    assert report.tensors_checked > 0 and report.checkpoints == [sftp_backend.url]


def test_saving_to_sftp_round_trips(sftp_backend: Backend) -> None:
    state = sample_state()
    save(state, sftp_backend)
    assert_state_equal(load(empty_like_state(state), sftp_backend), state)


def test_a_missing_sftp_checkpoint_is_an_error_naming_the_url(sftp_backend: Backend) -> None:
    reader = FsspecStorageReader(sftp_backend.url, storage_options=sftp_backend.storage_options)
    with pytest.raises(CheckpointNotFoundError) as raised:
        reader.read_metadata()
    assert sftp_backend.url in str(raised.value)


def test_an_sftp_pointer_update_that_fails_before_its_rename_leaves_the_old_pointer_whole(
    sftp_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guarantee row: 'the pointer latest_checkpoint.txt is replaced atomically' (SFTP)"""
    import os

    from dcp_fsspec import StorageError
    from dcp_fsspec.checkpoint.commit import pointer
    from dcp_fsspec.storage.format.names import POINTER_NAME
    from dcp_fsspec.storage.transport.urls import resolve

    root = resolve(sftp_backend.url, sftp_backend.storage_options)
    assert type(root.backend).__name__ == "SftpBackend"
    assert pointer.write_pointer(root, 3)

    def rename_fails(*args: object, **kwargs: object) -> None:
        raise OSError("connection lost before the rename")

    monkeypatch.setattr(root.fs, "mv", rename_fails)  # sshfs sets its sync methods per instance
    with pytest.raises(StorageError) as raised:
        pointer.write_pointer(root, 5)
    assert sftp_backend.url in str(raised.value)
    monkeypatch.undo()
    assert pointer.read_pointer(root) == 3  # the new bytes never replaced the old ones in place
    assert os.listdir(_local_path(sftp_backend)) == [POINTER_NAME]  # no temporary file left


def test_an_sshfs_filesystem_unpickled_in_another_process_still_gets_the_sftp_backend(
    sftp_backend: Backend,
) -> None:
    # sshfs leaves protocol = "abstract" on its class until fsspec's registry sets it; a class
    # imported by unpickling (DCP's process executor) never had it set.
    import sshfs

    from dcp_fsspec.storage.backends import backend_for
    from dcp_fsspec.storage.backends.sftp import SftpBackend

    fs = sftp_backend.fs
    class_protocol = sshfs.SSHFileSystem.protocol
    try:
        sshfs.SSHFileSystem.protocol = "abstract"
        assert isinstance(backend_for(fs), SftpBackend)
    finally:
        sshfs.SSHFileSystem.protocol = class_protocol
