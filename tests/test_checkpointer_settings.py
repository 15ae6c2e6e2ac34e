"""Settings that flow from the Checkpointer down, and what one save costs in pointer reads.

``retry``, ``writer_settings`` and ``reader_settings`` must reach every writer and reader the
Checkpointer makes, the asynchronous background process's included; each is checked by what it
changes on storage or in behaviour, not by looking inside the Checkpointer.
"""

from __future__ import annotations

import inspect
import posixpath
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dcp_fsspec import (
    Checkpointer,
    CorruptCheckpointError,
    FsspecStorageReader,
    FsspecStorageWriter,
    ReaderSettings,
    RetryPolicy,
    StorageError,
    WriterSettings,
    verify,
)
from dcp_fsspec.checkpoint.commit import pointer
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, METADATA_NAME, POINTER_NAME
from tests.conftest import Backend

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(240),
]

ELEMENTS = 4096


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((ELEMENTS,), value), "b": torch.arange(8.0) + value, "step": int(value)}


@pytest.mark.parametrize(
    ("constructor", "own"),
    [
        (FsspecStorageWriter, ["path", "storage_options", "settings", "retry", "incremental", "base"]),
        (
            FsspecStorageReader,
            ["path", "storage_options", "settings", "retry", "process_group", "references"],
        ),
    ],
)
def test_the_storage_classes_take_a_url_its_options_one_settings_value_and_torchs_keywords(
    constructor: type, own: list[str]
) -> None:
    parameters = inspect.signature(constructor).parameters
    public = [name for name, p in parameters.items() if not name.startswith("_") and p.kind != p.VAR_KEYWORD]
    assert public == own
    assert (
        list(parameters.values())[-1].kind == inspect.Parameter.VAR_KEYWORD
    )  # torch's, then storage options


@pytest.mark.parametrize(
    ("constructor", "field", "settings"),
    [
        (FsspecStorageWriter, "part_size", "WriterSettings"),
        (FsspecStorageReader, "window_bytes", "ReaderSettings"),
    ],
)
def test_a_setting_given_as_a_keyword_is_refused_naming_where_it_goes(
    memory_backend: Backend, constructor: type, field: str, settings: str
) -> None:
    with pytest.raises(TypeError, match=rf"settings={settings}\({field}=1024\)"):
        constructor(memory_backend.url, **{field: 1024})


def test_torchs_keywords_keep_their_meaning(memory_backend: Backend) -> None:
    writer = FsspecStorageWriter(memory_backend.url, thread_count=3, sync_files=False, overwrite=False)
    assert (writer.thread_count, writer.settings.files_per_rank, writer.sync_files, writer.overwrite) == (
        3,
        3,
        False,
        False,
    )
    with pytest.raises(ValueError, match="thread_count=3 and files_per_rank=2"):
        FsspecStorageWriter(memory_backend.url, settings=WriterSettings(files_per_rank=2), thread_count=3)


@pytest.mark.parametrize("async_mode", ["disabled", "async_with_pinned_mem"])
def test_writer_settings_without_checksums_write_records_without_a_crc(
    local_backend: Backend, async_mode: str
) -> None:
    with Checkpointer(
        local_backend.url,
        async_mode=async_mode,
        retry=RetryPolicy(attempts=1),
        writer_settings=WriterSettings(checksums=False),
    ) as ckpt:
        ckpt.save(1, trainer=_state(1.0))
    report = verify(local_backend.sub("iter_000000001", "trainer"))
    assert report.ok and report.tensors_checked == 0 and report.unchecked == report.items == 3


def _flip_a_byte_of_w(backend: Backend) -> None:
    folder = backend.sub("iter_000000001", "trainer")
    data_files = [p for p in backend.fs.ls(folder, detail=False) if p.endswith(".distcp")]
    data_file = max(data_files, key=backend.fs.size)  # the one holding "w", which fills its middle
    size = backend.fs.size(data_file)
    with open(data_file, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x40]))


def test_reader_settings_reach_the_readers_of_a_load(local_backend: Backend) -> None:
    with Checkpointer(local_backend.url) as ckpt:
        ckpt.save(1, trainer=_state(1.0))
    _flip_a_byte_of_w(local_backend)
    with Checkpointer(local_backend.url) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(trainer=_state(0.0))
    assert local_backend.sub("iter_000000001", "trainer") in str(info.value)
    target = _state(0.0)
    with Checkpointer(local_backend.url, reader_settings=ReaderSettings(verify_checksums=False)) as ckpt:
        assert ckpt.load(trainer=target) == 1
    assert int((target["w"] != 1.0).sum()) == 1  # the damage went unchecked, as asked


def _fail_each_first_read(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Reads of the pointer, commit records and ``.metadata`` each fail the first time, as if
    the connection dropped; returns ``(method, path)`` of each failure."""
    fs, failed = backend.fs, []

    def flaky(name: str) -> Callable[..., Any]:
        method = getattr(fs, name)

        def call(path: str, *args: Any, **kwargs: Any) -> Any:
            watched = (POINTER_NAME, COMMIT_RECORD_NAME, METADATA_NAME)
            if posixpath.basename(path) in watched and (name, path) not in failed:
                failed.append((name, path))
                raise ConnectionResetError(f"connection reset reading {path}")
            return method(path, *args, **kwargs)

        return call

    for name in ("cat_file", "exists"):
        monkeypatch.setattr(fs, name, flaky(name))
    return failed


def test_the_retry_policy_reaches_the_pointer_and_every_writer_and_reader(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = _fail_each_first_read(memory_backend, monkeypatch)
    with (
        Checkpointer(memory_backend.url, retry=RetryPolicy(attempts=1)) as ckpt,
        pytest.raises(StorageError) as info,
    ):
        ckpt.save(1, trainer=_state(1.0))
    assert memory_backend.sub(POINTER_NAME) in str(info.value)

    retried = RetryPolicy(attempts=2, base_delay=0.0, deadline=None)
    with Checkpointer(memory_backend.url, retry=retried) as ckpt:
        ckpt.save(1, trainer=_state(1.0))
    key_metadata = memory_backend.fs._strip_protocol(
        memory_backend.sub("iter_000000001", "trainer", ".metadata")
    )
    assert ("cat_file", key_metadata) in failed  # the writer's check before writing (one GET), retried
    failed.clear()  # the load's first reads fail once more
    target = _state(0.0)
    with Checkpointer(memory_backend.url, retry=retried) as ckpt:
        assert ckpt.load(trainer=target) == 1
    assert torch.equal(target["w"], torch.full((ELEMENTS,), 1.0))
    assert ("cat_file", key_metadata) in failed  # the reader's read, retried


def test_one_save_reads_the_pointer_at_most_twice(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(memory_backend.url, keep_last_n=1) as ckpt:
        ckpt.save(1, trainer=_state(1.0))
        reads = []
        real_read = pointer.read_pointer_file

        def counting(root: Any) -> Any:
            reads.append(root.url)
            return real_read(root)

        monkeypatch.setattr(pointer, "read_pointer_file", counting)
        ckpt.save(2, trainer=_state(2.0))  # prepare, write, commit and move the pointer, retention
        assert ckpt.committed_iterations() == [2]  # retention ran, and deleted iteration 1
    assert reads == [memory_backend.url] * 2, reads
