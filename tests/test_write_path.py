"""The local write path and the paused collector: small pieces that the save speed rests on."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from dcp_fsspec.storage.backends.local import LocalUpload
from dcp_fsspec.storage.transport.gc_pause import collector_paused


def test_local_upload_survives_short_writev_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_writev = os.writev
    calls = []

    def short_writev(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        return real_writev(fd, [b"".join(bytes(b) for b in buffers)[:100_003]])

    monkeypatch.setattr(os, "writev", short_writev)
    pieces = [bytes([i % 256]) * (i * 13 % 97) for i in range(300)] + [os.urandom(3 << 20)]
    upload = LocalUpload(LocalFileSystem(), str(tmp_path / "f"))
    for i in range(0, len(pieces), 3):
        upload.write(pieces[i : i + 3])
    upload.commit()
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)
    assert upload.size == sum(map(len, pieces))
    assert max(calls) > 1  # many pieces per call, not one write per piece


def test_collector_is_paused_on_the_main_thread_and_restored() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("restored on errors too")
    assert gc.isenabled()


def test_collector_is_left_alone_off_the_main_thread_and_when_the_caller_disabled_it() -> None:
    seen = []

    def work() -> None:
        with collector_paused():
            seen.append(gc.isenabled())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [True]
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # not switched on behind the caller's back
    finally:
        gc.enable()


def test_saves_and_loads_run_with_the_collector_paused_and_switch_it_back_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What README says: the writer's ``write_data`` and the reader's ``read_data`` pause the
    collector in a plain ``dcp.save`` / ``dcp.load``; a Checkpointer pauses it for its whole save
    and load, DCP's planning included; after each (a failed one too) it is on again."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_fsspec import Checkpointer, CheckpointExistsError, FsspecStorageReader, FsspecStorageWriter
    from dcp_fsspec.storage.write import writer as writer_module

    seen: dict[str, list[bool]] = {}

    def spy(owner: object, name: str, label: str) -> None:
        real = getattr(owner, name)

        def recording(*args: object, **kwargs: object) -> object:
            seen.setdefault(label, []).append(gc.isenabled())
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, recording)

    spy(writer_module, "split_into_files", "inside write_data")  # called only by write_data
    spy(FsspecStorageReader, "_records_for", "inside read_data")  # called only by read_data
    spy(FsspecStorageWriter, "prepare_local_plan", "writer planning")  # not paused by the writer
    spy(FsspecStorageReader, "prepare_local_plan", "reader planning")

    state = {"w": torch.arange(1000, dtype=torch.float32)}
    dcp.save(state, storage_writer=FsspecStorageWriter(str(tmp_path / "plain")))
    dcp.load(state, storage_reader=FsspecStorageReader(str(tmp_path / "plain")))
    assert gc.isenabled()
    assert seen == {
        "writer planning": [True],
        "inside write_data": [False],
        "reader planning": [True],
        "inside read_data": [False],
    }

    seen.clear()
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(1, model=state)
        assert gc.isenabled()
        ckpt.load(model=state)
        assert gc.isenabled()
        with pytest.raises(CheckpointExistsError):
            ckpt.save(1, model=state)
        assert gc.isenabled()
    assert seen["writer planning"][0] is False and seen["reader planning"][0] is False
    assert not any(seen["inside write_data"]) and not any(seen["inside read_data"])


def test_an_integration_s_blocking_dcp_call_pauses_the_collector_through_planning_and_restores_it_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``integrations._files.blocking`` (our torchtitan and Lightning checkpointers' synchronous
    ``dcp.save``/``dcp.load``): DCP's planning runs paused, which the writer's own pause does not
    reach, and a failed save switches the collector back on and raises our error."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_fsspec import CheckpointExistsError, FsspecStorageWriter
    from dcp_fsspec.integrations._files import blocking

    seen: list[bool] = []
    real = FsspecStorageWriter.prepare_local_plan

    def recording(self: FsspecStorageWriter, plan: object) -> object:
        seen.append(gc.isenabled())
        return real(self, plan)  # type: ignore[arg-type]

    monkeypatch.setattr(FsspecStorageWriter, "prepare_local_plan", recording)
    url = str(tmp_path / "ckpt")
    state = {"w": torch.ones(10)}
    blocking(lambda: dcp.save(state, storage_writer=FsspecStorageWriter(url)), f"saving {url}")
    assert seen == [False] and gc.isenabled()
    with pytest.raises(CheckpointExistsError):
        blocking(
            lambda: dcp.save(state, storage_writer=FsspecStorageWriter(url, overwrite=False)), f"saving {url}"
        )
    assert gc.isenabled()


def test_finish_pickles_metadata_straight_into_the_local_file_without_a_copy_of_its_bytes(
    tmp_path: Path,
) -> None:
    import pickle
    import tracemalloc

    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_fsspec import FsspecStorageWriter

    # Many small objects, as a large save's chunk entries are: the pickler's frames, not one buffer.
    pieces = [i.to_bytes(4, "big") * 64 for i in range(100_000)]
    pickled_bytes = len(pickle.dumps(pieces))
    writer = FsspecStorageWriter(str(tmp_path / "ckpt"))
    writer.reset()
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    tracemalloc.start()
    try:
        writer.finish(Metadata(state_dict_metadata={}, planner_data=pieces), [])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:
        assert pickle.load(f).planner_data == pieces
    assert peak < pickled_bytes / 2, f"finish held {peak:,} bytes while writing {pickled_bytes:,}"
