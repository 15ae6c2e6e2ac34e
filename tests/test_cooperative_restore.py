"""Cooperative restore on real gloo ranks and a real S3 API (moto behind a counting proxy).

Each byte several ranks need is read from the store once and broadcast; the loads must match a
load without cooperation bit for bit, the server must send about the checkpoint's bytes once,
and a failure on the rank that reads fails every rank with the same error.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_fsspec import (
    Checkpointer,
    FsspecStorageReader,
    FsspecStorageWriter,
    ReaderSettings,
)
from dcp_fsspec.errors import ChecksumMismatchError, StorageError
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.transport.retry import RetryPolicy
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.helpers import save
from tests.servers.counting import CountingProxy

MiB = 1024 * 1024
# Small requests and window: a few MiB of state still takes several rounds and pieces.
SMALL_READS: dict[str, Any] = {"max_request_bytes": 256 * 1024, "window_bytes": 1 * MiB}


def replicated_state() -> dict[str, Any]:
    """What a DDP replica holds: a few tensors of 1 MiB or less, and a non-tensor entry."""
    gen = torch.Generator().manual_seed(11)
    state: dict[str, Any] = {
        f"layer{i}.weight": torch.randn(512, 512 // (i + 1), generator=gen) for i in range(6)
    }
    state["step"] = torch.tensor(41)
    state["extra"] = {"epoch": 3, "name": "run-7"}
    return state


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    """Targets for ``state``: zeros, and ``None`` for each non-tensor leaf."""
    return {
        k: torch.zeros_like(v)
        if isinstance(v, torch.Tensor)
        else zeros_like(v)
        if isinstance(v, dict)
        else None
        for k, v in state.items()
    }


def unique_bytes(backend: Backend, under: str = "") -> int:
    """The bytes of every file of the checkpoint (or of its folder ``under``), each once."""
    fs, root = fsspec.core.url_to_fs(backend.sub(under) if under else backend.url, **backend.storage_options)
    return sum(int(entry["size"]) for entry in fs.find(root, detail=True).values())


def through(backend: Backend, proxy: CountingProxy) -> dict[str, Any]:
    """``backend``'s storage options, reaching the server through ``proxy``."""
    options = dict(backend.storage_options)
    options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
    return options


@pytest.fixture
def proxies(s3_server: LocalS3Server) -> Iterator[list[CountingProxy]]:
    """Four counting proxies in front of moto: one per rank."""
    started = [CountingProxy(s3_server.endpoint_url).start() for _ in range(4)]
    try:
        yield started
    finally:
        for proxy in started:
            proxy.stop()


def _load_and_compare(
    rank: int, world_size: int, url: str, options: list[dict[str, Any]], direct: dict[str, Any]
) -> None:
    """Load cooperatively through this rank's proxy; compare with a load without cooperation."""
    expected = replicated_state()
    alone = zeros_like(expected)
    dcp.load(
        alone,
        storage_reader=FsspecStorageReader(
            url, storage_options=direct, settings=ReaderSettings(**SMALL_READS)
        ),
    )
    dist.barrier()
    together = zeros_like(expected)
    reader = FsspecStorageReader(
        url, storage_options=options[rank], settings=ReaderSettings(cooperative=True, **SMALL_READS)
    )
    dcp.load(together, storage_reader=reader)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(together[key], alone[key]) and torch.equal(together[key], value), key
        else:
            assert together[key] == alone[key] == value, key


def _count_cooperative_load(
    s3_backend: Backend, proxies: list[CountingProxy], tmp_path: Path, world_size: int
) -> tuple[int, int]:
    save(replicated_state(), s3_backend)
    options = [through(s3_backend, p) for p in proxies[:world_size]]
    counted = proxies[:world_size]
    run_ranks(_load_and_compare, world_size, tmp_path, s3_backend.url, options, s3_backend.storage_options)
    return sum(p.sent for p in counted), unique_bytes(s3_backend)


def test_two_ranks_read_each_byte_of_a_replicated_state_once_and_load_it_bit_exact(
    s3_backend: Backend, proxies: list[CountingProxy], tmp_path: Path
) -> None:
    sent, unique = _count_cooperative_load(s3_backend, proxies, tmp_path, 2)
    assert sent <= 1.05 * unique, (sent, unique)
    assert min(p.sent for p in proxies[:2]) > 0.3 * unique  # both ranks read a share
    # The preflight's listing of the data files, like .metadata, is rank 0's, and shared.
    assert sum(p.lists for p in proxies[:2]) == 1, [p.lists for p in proxies[:2]]


@pytest.mark.slow
def test_four_ranks_read_each_byte_of_a_replicated_state_once_and_load_it_bit_exact(
    s3_backend: Backend, proxies: list[CountingProxy], tmp_path: Path
) -> None:
    sent, unique = _count_cooperative_load(s3_backend, proxies, tmp_path, 4)
    assert sent <= 1.05 * unique, (sent, unique)
    assert min(p.sent for p in proxies) > 0.15 * unique


def _load_expecting_failure(
    rank: int, world_size: int, url: str, options: list[dict[str, Any]], kind: type[Exception], named: str
) -> None:
    """Load cooperatively; every rank must fail with the same ``kind`` of error naming ``named``."""
    retry = RetryPolicy(attempts=2, base_delay=0.01, deadline=60)
    reader = FsspecStorageReader(
        url,
        storage_options=options[rank],
        retry=retry,
        settings=ReaderSettings(cooperative=True, **SMALL_READS),
    )
    with pytest.raises(CheckpointException) as raised:
        dcp.load(zeros_like(replicated_state()), storage_reader=reader)
    failures = {r: e for r, (e, _trace) in raised.value.failures.items()}
    assert sorted(failures) == list(range(world_size)), failures  # every rank failed
    assert all(type(e) is kind and named in str(e) for e in failures.values()), failures
    assert len({str(e) for e in failures.values()}) == 1, failures  # the same error


def test_a_connection_cut_on_a_reading_rank_fails_every_rank_with_its_error(
    s3_backend: Backend, s3_server: LocalS3Server, tmp_path: Path
) -> None:
    save(replicated_state(), s3_backend)
    healthy, cut = (
        CountingProxy(s3_server.endpoint_url).start(),
        CountingProxy(s3_server.endpoint_url, cut_after=64 * 1024).start(),
    )
    try:
        options = [through(s3_backend, healthy), through(s3_backend, cut)]
        run_ranks(_load_expecting_failure, 2, tmp_path, s3_backend.url, options, StorageError, s3_backend.url)
    finally:
        healthy.stop()
        cut.stop()
    assert cut.cut


def _flip_a_byte_inside(backend: Backend, fqn: str) -> str:
    """Flip one byte in the middle of ``fqn``'s stored record; return its data file's URL."""
    fs, root = fsspec.core.url_to_fs(backend.url, **backend.storage_options)
    metadata = pickle.loads(fs.cat_file(f"{root}/.metadata"))  # our own test checkpoint
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    path = f"{root}/{info.relative_path}"
    data = bytearray(fs.cat_file(path))
    data[info.offset + info.length // 2] ^= 0x40
    fs.pipe_file(path, bytes(data))
    return backend.sub(info.relative_path)


@pytest.mark.parametrize("fqn", ["layer3.weight", "layer0.weight"], ids=["in-one-piece", "across-pieces"])
def test_a_flipped_byte_fails_every_rank_with_a_checksum_mismatch_naming_the_file(
    s3_backend: Backend, proxies: list[CountingProxy], tmp_path: Path, fqn: str
) -> None:
    save(replicated_state(), s3_backend)
    file_url = _flip_a_byte_inside(s3_backend, fqn)
    options = [through(s3_backend, p) for p in proxies[:2]]
    run_ranks(_load_expecting_failure, 2, tmp_path, s3_backend.url, options, ChecksumMismatchError, file_url)
    assert sum(p.sent for p in proxies) <= 1.05 * unique_bytes(s3_backend)  # the bytes were read once


def _checkpointer_round_trip(
    rank: int,
    world_size: int,
    url: str,
    direct: dict[str, Any],
    options: list[dict[str, Any]],
    cooperative: bool | None,
) -> None:
    expected = replicated_state()
    with Checkpointer(url, storage_options=direct) as ckpt:
        ckpt.save(1, state=expected)
    settings = ReaderSettings(cooperative=cooperative, **SMALL_READS)
    back = zeros_like(expected)
    with Checkpointer(url, storage_options=options[rank], reader_settings=settings) as ckpt:
        assert ckpt.load(state=back) == 1
    for key, value in expected.items():
        assert torch.equal(back[key], value) if isinstance(value, torch.Tensor) else back[key] == value, key


@pytest.mark.parametrize("cooperative", [None, False], ids=["default", "off"])
def test_checkpointer_load_on_two_ranks_reads_each_byte_once_unless_cooperation_is_off(
    s3_backend: Backend, proxies: list[CountingProxy], tmp_path: Path, cooperative: bool | None
) -> None:
    options = [through(s3_backend, p) for p in proxies[:2]]
    run_ranks(
        _checkpointer_round_trip,
        2,
        tmp_path,
        s3_backend.url,
        s3_backend.storage_options,
        options,
        cooperative,
    )
    sent, unique = sum(p.sent for p in proxies), unique_bytes(s3_backend, "iter_000000001")
    if cooperative is None:
        assert sent <= 1.05 * unique, (sent, unique)
    else:
        assert sent > 1.8 * unique, (sent, unique)


def test_a_plain_reader_does_not_cooperate_unless_asked() -> None:
    assert ReaderSettings().cooperative is None and not FsspecStorageReader("memory://x").cooperative


def full_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "w1": torch.randn(512, 256, generator=gen),
        "w2": torch.randn(40_000, generator=gen),
        "b": torch.randn(64, 48, generator=gen),
    }


def _load_dtensors(
    rank: int,
    world_size: int,
    url: str,
    options: list[dict[str, Any]],
    direct: dict[str, Any],
    shape: tuple[int, ...],
    placements: dict[str, list[Any]],
) -> None:
    """Load ``full_tensors`` (saved by one process) into DTensors on ``shape``: with cooperation
    through this rank's proxy, and without; both must hold this rank's part of the saved tensors."""
    mesh = init_device_mesh("cpu", shape)
    full = full_tensors()

    def targets() -> dict[str, Any]:
        state: dict[str, Any] = {
            k: distribute_tensor(torch.zeros_like(v), mesh, placements[k]) for k, v in full.items()
        }
        return {**state, "step": torch.tensor(0), "extra": {"epoch": None}}

    alone = targets()
    dcp.load(
        alone,
        storage_reader=FsspecStorageReader(
            url, storage_options=direct, settings=ReaderSettings(**SMALL_READS)
        ),
    )
    together = targets()
    dcp.load(
        together,
        storage_reader=FsspecStorageReader(
            url, storage_options=options[rank], settings=ReaderSettings(cooperative=True, **SMALL_READS)
        ),
    )
    for key, value in full.items():
        mine = distribute_tensor(value, mesh, placements[key]).to_local()
        assert isinstance(together[key], DTensor) and torch.equal(
            together[key].to_local(), alone[key].to_local()
        ), key
        assert torch.equal(together[key].to_local(), mine), key
    assert together["step"] == 41 and together["extra"] == {"epoch": 3}


def _count_dtensor_load(
    s3_backend: Backend,
    proxies: list[CountingProxy],
    tmp_path: Path,
    shape: tuple[int, ...],
    placements: dict[str, list[Any]],
) -> tuple[int, int]:
    save({**full_tensors(), "step": torch.tensor(41), "extra": {"epoch": 3}}, s3_backend)
    ranks = len(torch.empty(shape).flatten()) if shape else 1
    options = [through(s3_backend, p) for p in proxies[:ranks]]
    run_ranks(
        _load_dtensors,
        ranks,
        tmp_path,
        s3_backend.url,
        options,
        s3_backend.storage_options,
        shape,
        placements,
    )
    return sum(p.sent for p in proxies), unique_bytes(s3_backend)


def test_two_ranks_load_replicated_sharded_and_non_tensor_entries_reading_each_byte_once(
    s3_backend: Backend, proxies: list[CountingProxy], tmp_path: Path
) -> None:
    placements = {"w1": [Shard(0)], "w2": [Replicate()], "b": [Shard(1)]}
    sent, unique = _count_dtensor_load(s3_backend, proxies, tmp_path, (2,), placements)
    assert sent <= 1.05 * unique, (sent, unique)


@pytest.mark.slow
def test_hsdp_on_a_two_by_two_mesh_reads_each_shard_once_for_both_replicas(
    s3_backend: Backend, proxies: list[CountingProxy], tmp_path: Path
) -> None:
    placements = {k: [Replicate(), Shard(0)] for k in full_tensors()}
    sent, unique = _count_dtensor_load(s3_backend, proxies, tmp_path, (2, 2), placements)
    assert sent <= 1.05 * unique, (sent, unique)


def _fsdp2_round_trip(rank: int, world_size: int, url: str, options: list[dict[str, Any]]) -> None:
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
        fully_shard(net, mesh=init_device_mesh("cpu", (world_size,)))
        return net

    saved = model(1)
    dcp.save(
        get_model_state_dict(saved), storage_writer=FsspecStorageWriter(url, storage_options=options[rank])
    )
    loaded = model(2)
    state = get_model_state_dict(loaded)
    dcp.load(
        state,
        storage_reader=FsspecStorageReader(
            url, storage_options=options[rank], settings=ReaderSettings(cooperative=True, **SMALL_READS)
        ),
    )
    set_model_state_dict(loaded, state)
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a.to_local(), b.to_local()), name


def test_fsdp2_model_saved_and_loaded_cooperatively_on_two_ranks(
    s3_backend: Backend, proxies: list[CountingProxy], tmp_path: Path
) -> None:
    options = [through(s3_backend, p) for p in proxies[:2]]
    run_ranks(_fsdp2_round_trip, 2, tmp_path, s3_backend.url, options)
