"""The local write path and the paused collector: small pieces that the save speed rests on."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from dcp_fsspec.storage.collector import collector_paused
from dcp_fsspec.storage.backends.local import LocalUpload


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
