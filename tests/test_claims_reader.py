"""The reader's tuning keywords do what the README says, counted, never timed.

README, ``FsspecStorageReader``: "downloads them concurrently (`window_bytes` bounds the
memory)", ``max_gap_bytes``: "neighbouring ranges closer than this are fetched in one request",
``threads``: "concurrent reads on filesystems without an async API". Measured on ``memory://``
(no async API, so every range goes through the thread pool and the window) with spies on the
fetch layer (:mod:`dcp_fsspec.storage.read.fetch`) and the backend's range reader. The S3 benchmark's
"10 requests, 1.00×" for 10,000 small tensors is counted on moto, request by request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import s3fs
import torch

from dcp_fsspec.storage.backends import RangeReader
from dcp_fsspec.storage.read import fetch
from dcp_fsspec.storage.read import reader as reader_module
from tests.conftest import Backend
from tests.helpers import load, save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

KiB = 1024
TENSORS = 32
ELEMENTS = 16 * KiB  # 64 KiB of float32 each


def _state(fill: float | None = None) -> dict[str, torch.Tensor]:
    return {
        f"t{i:02d}": (torch.full((ELEMENTS,), float(i)) if fill is None else torch.full((ELEMENTS,), fill))
        for i in range(TENSORS)
    }


def _assert_loaded(loaded: dict[str, torch.Tensor]) -> None:
    for name, tensor in loaded.items():
        assert torch.equal(tensor, torch.full((ELEMENTS,), float(int(name[1:])))), name


def test_downloaded_but_unconsumed_bytes_never_exceed_window_bytes_plus_one_request(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: "`window_bytes` bounds the memory" of a load."""
    save(_state(), memory_backend)
    window, request = 256 * KiB, 64 * KiB
    held = {"now": 0, "peak": 0, "spans": 0}
    real_start = fetch._Fetcher.start
    real_fetch = reader_module.fetch_in_order

    def start(self: Any, span: fetch.Span) -> Any:
        held["now"] += span.size
        held["peak"] = max(held["peak"], held["now"])
        held["spans"] += 1
        return real_start(self, span)

    def consumed_when_the_next_is_asked(fs: Any, spans: list[fetch.Span], **kwargs: Any) -> Iterator[Any]:
        for span, data in real_fetch(fs, spans, **kwargs):
            yield span, data
            held["now"] -= span.size  # the reader asked for the next: it is done with this one

    monkeypatch.setattr(fetch._Fetcher, "start", start)
    monkeypatch.setattr(reader_module, "fetch_in_order", consumed_when_the_next_is_asked)
    loaded = load(_state(-1.0), memory_backend, window_bytes=window, max_request_bytes=request)
    _assert_loaded(loaded)
    total = TENSORS * ELEMENTS * 4
    assert held["spans"] >= total // request  # the load went through the window, in many requests
    assert window <= held["peak"] <= window + request, held


def test_ranges_closer_than_max_gap_bytes_are_one_request_and_farther_ones_are_not(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: "neighbouring ranges closer than this [max_gap_bytes] are fetched in one request"."""
    save(_state(), memory_backend)
    requests: list[int] = []
    real_read = RangeReader.read

    def read(self: RangeReader, path: str, size: int, offset: int) -> bytes:
        requests.append(size)
        return real_read(self, path, size, offset)

    monkeypatch.setattr(RangeReader, "read", read)
    every_other = {
        name: t for name, t in _state(-1.0).items() if int(name[1:]) % 2 == 0
    }  # gaps of one tensor
    wanted = len(every_other) * ELEMENTS * 4
    load(every_other, memory_backend, max_gap_bytes=128 * KiB, max_request_bytes=16 * 1024 * KiB)
    assert len(requests) == 1 and wanted < requests[0] < 2 * wanted, requests  # the gaps came along
    requests.clear()
    _assert_loaded(
        load(every_other, memory_backend, max_gap_bytes=1 * KiB, max_request_bytes=16 * 1024 * KiB)
    )
    assert len(requests) == len(every_other) and wanted <= sum(requests) < wanted + 64 * KiB, requests


def test_a_load_reads_on_exactly_threads_threads_at_once(
    memory_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: ``threads``, "concurrent reads on filesystems without an async API".

    Above the small-load bound (README: a load of at most 16 MiB from local disk or memory:// reads
    on the calling thread), lowered here so the small test state counts as large.
    """
    monkeypatch.setattr(reader_module, "_ON_THIS_THREAD_MAX", 0)
    save(_state(), memory_backend)
    threads = 4
    together = threading.Barrier(
        threads, timeout=60
    )  # a deadline, not a measure: broken if fewer run at once
    readers: set[str] = set()
    first = iter(range(threads))
    lock = threading.Lock()
    real_read = RangeReader.read

    def read(self: RangeReader, path: str, size: int, offset: int) -> bytes:
        with lock:
            readers.add(threading.current_thread().name)
            waits = next(first, None) is not None
        if waits:
            together.wait()
        return real_read(self, path, size, offset)

    monkeypatch.setattr(RangeReader, "read", read)
    _assert_loaded(load(_state(-1.0), memory_backend, threads=threads, max_request_bytes=64 * KiB))
    assert len(readers) == threads, readers


def test_a_load_of_ten_thousand_small_tensors_from_s3_is_ten_requests_downloading_the_checkpoint_once(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README, the S3 benchmark: 10,000 small tensors (83 MiB) load in "10 requests, 1.00×" downloaded.

    Every request s3fs sends is counted, and the bytes of every GET's body.
    """
    sizes = torch.randint(KiB, 16 * KiB + 1, (10_000,), generator=torch.Generator().manual_seed(0)) // 4
    state = {f"small.{i}.weight": torch.full((int(n),), float(i)) for i, n in enumerate(sizes)}
    save(state, s3_backend)
    fs = s3_backend.fs
    fs.invalidate_cache()
    stored = sum(fs.du(fs._strip_protocol(s3_backend.url), total=False).values())
    counted: dict[str, int] = {}
    downloaded = 0
    real_call = s3fs.S3FileSystem._call_s3

    async def counting(self: s3fs.S3FileSystem, method: str, *args: Any, **kwargs: Any) -> Any:
        nonlocal downloaded
        counted[method] = counted.get(method, 0) + 1
        response = await real_call(self, method, *args, **kwargs)
        if method == "get_object":
            downloaded += int(response["ContentLength"])
        return response

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    target = {name: torch.zeros_like(t) for name, t in state.items()}
    load(target, s3_backend)
    monkeypatch.undo()
    assert all(torch.equal(target[name], t) for name, t in state.items())
    raw = sum(t.numel() * 4 for t in state.values())
    assert 80 * 1024 * KiB < raw < 86 * 1024 * KiB, (
        raw,
        fs.du(fs._strip_protocol(s3_backend.url), total=False),
    )
    assert sum(counted.values()) <= 10, counted
    assert round(downloaded / stored, 2) == 1.00, (downloaded, stored)
