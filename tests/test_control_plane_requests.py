"""Control-plane requests at N ranks: a save and a resume ask storage the same questions at any N.

Every request that is not a rank's own data (listings, HEADs, reads of ``.metadata``, the commit
record and the pointer, the existence checks) is made by one rank and shared over the process
group. Only the data files' uploads grow with the number of ranks. Counted by a proxy in front of
moto that records each request's method and object.
"""

from __future__ import annotations

import asyncio
import pickle
import re
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsspec import CheckpointExistsError, FsspecStorageWriter
from dcp_fsspec.errors import UsageError
from dcp_fsspec.local_s3 import LocalS3Server
from tests.conftest import Backend
from tests.control_plane_ranks import KEYS, RESUME_MARK, SAVES, save_then_resume
from tests.distributed import run_ranks
from tests.servers.counting import CountingProxy

pytestmark = pytest.mark.timeout(600)

_REQUEST_LINE = re.compile(rb"^([A-Z]+) (\S+) HTTP/1\.[01]\r\n")
Requests = list[tuple[str, str]]


class RequestLog(CountingProxy):
    """A :class:`CountingProxy` that also keeps each request's kind and object, in order."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.requests: list[tuple[str, str]] = []

    def reset(self) -> None:
        super().reset()
        self.requests = []

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                # botocore writes each request's head in one go: a request line starts a chunk.
                if match := _REQUEST_LINE.match(chunk):
                    self.requests.append(_kind(match[1].decode(), match[2].decode()))
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.close()


def _kind(method: str, target: str) -> tuple[str, str]:
    """(``LIST``, ``HEAD``, ``GET``, ``PUT``, ...; the object's last name, or ``bucket``)."""
    path, _, query = target.partition("?")
    parts = path.strip("/").split("/", 1)
    name = parts[1].rsplit("/", 1)[-1] if len(parts) > 1 else "bucket"
    if method == "GET" and name == "bucket":
        method = "LIST"
    elif method == "POST" and "delete" in query:
        method = "DELETE"
    return method, name


def _is_data(name: str) -> bool:
    return name.endswith(".distcp")


def _control_plane(requests: list[tuple[str, str]]) -> Counter[str]:
    """Requests that are not data files', by kind and by the file they name."""
    return Counter(f"{method} {name}" for method, name in requests if not _is_data(name))


def _data_puts(requests: list[tuple[str, str]]) -> int:
    return sum(method in ("PUT", "POST") and _is_data(name) for method, name in requests)


def _counts(world_size: int, s3_server: LocalS3Server, url: str, tmp_path: Path) -> tuple[Requests, Requests]:
    """Every request of the saves, then of one resume, at ``world_size`` ranks."""
    proxy = RequestLog(s3_server.endpoint_url).start()
    try:
        options = s3_server.storage_options()
        options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
        run_ranks(save_then_resume, world_size, tmp_path, url, options)
        mark = proxy.requests.index(("GET", RESUME_MARK))
        return proxy.requests[:mark], proxy.requests[mark + 1 :]
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def at_two_ranks(
    s3_server: LocalS3Server, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Requests, Requests]:
    """The requests at two ranks, which every other number of ranks must repeat."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in s3_server.environ().items():
            monkeypatch.setenv(name, value)
        bucket = f"two-ranks-{uuid.uuid4().hex[:12]}"
        s3_server.create_bucket(bucket)
        return _counts(2, s3_server, f"s3://{bucket}/ckpt/2-ranks/run", tmp_path_factory.mktemp("two-ranks"))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4, 8, 16])
def test_a_save_and_a_resume_make_the_same_control_plane_requests_at_any_number_of_ranks(
    world_size: int,
    at_two_ranks: tuple[Requests, Requests],
    s3_server: LocalS3Server,
    s3_backend: Backend,
    tmp_path: Path,
) -> None:
    two_saves, two_resume = at_two_ranks
    saves, resume = _counts(world_size, s3_server, s3_backend.sub(f"{world_size}-ranks", "run"), tmp_path)
    assert _control_plane(saves) == _control_plane(two_saves)
    assert _control_plane(resume) == _control_plane(two_resume)
    # Only the data files grow with the ranks: each rank writes its own, for each key.
    assert _data_puts(two_saves) == 2 * SAVES * len(KEYS)
    assert _data_puts(saves) == world_size * SAVES * len(KEYS)


def _save_twice_without_overwrite(rank: int, world_size: int, url: str, use_collectives: bool) -> None:
    """Save, then save again at the same URL with ``overwrite=False``: every rank must refuse."""
    state = {f"rank{rank}": torch.full((8,), float(rank))}
    dcp.save(state, storage_writer=FsspecStorageWriter(url), use_collectives=use_collectives)
    dist.barrier()
    before = {p.name: p.read_bytes() for p in Path(url).iterdir()}
    again = {f"rank{rank}": torch.full((8,), -1.0)}
    writer = FsspecStorageWriter(url, overwrite=False)
    # DCP wraps a failure of its collective steps, one per rank; without them it passes it on.
    with pytest.raises((CheckpointException, CheckpointExistsError)) as raised:
        dcp.save(again, storage_writer=writer, use_collectives=use_collectives)
    error = raised.value
    failures = [e for e, _ in error.failures.values()] if isinstance(error, CheckpointException) else [error]
    assert failures and all(isinstance(e, CheckpointExistsError) for e in failures)
    assert all(url in str(e) for e in failures)
    dist.barrier()
    assert {p.name: p.read_bytes() for p in Path(url).iterdir()} == before


@pytest.mark.slow
@pytest.mark.parametrize("use_collectives", [True, False], ids=["coordinated", "each-rank-alone"])
def test_a_save_over_a_checkpoint_without_overwrite_fails_every_rank_and_leaves_its_files_unchanged(
    tmp_path: Path, use_collectives: bool
) -> None:
    """The coordinator's check (or each rank's own, without collectives) refuses before any rank
    writes a byte: the first checkpoint's files keep their bytes."""
    url = str(tmp_path / "ckpt")
    run_ranks(_save_twice_without_overwrite, 2, tmp_path, url, use_collectives)
    assert len(list(Path(url).glob("*.distcp"))) == 2


def _cached_planner() -> DefaultSavePlanner:
    return DefaultSavePlanner(enable_plan_caching=True)


def test_a_save_from_torchs_cached_plan_writes_the_metadata_of_a_full_plan(tmp_path: Path) -> None:
    state = {"w": torch.arange(10.0), "b": torch.ones(3), "step": 3}
    for name, planner in (("first", _cached_planner()), ("cached", _cached_planner()), ("full", None)):
        dcp.save(
            state, storage_writer=FsspecStorageWriter(str(tmp_path / name)), planner=planner, no_dist=True
        )
    cached, full = (pickle.loads((tmp_path / name / ".metadata").read_bytes()) for name in ("cached", "full"))
    assert cached.state_dict_metadata == full.state_dict_metadata
    assert cached.storage_data == full.storage_data


def test_an_incremental_save_from_torchs_cached_plan_is_refused_naming_the_url(tmp_path: Path) -> None:
    """A cached plan holds the base records of the save that cached it, not this save's base."""
    state = {"w": torch.arange(10.0)}
    first = FsspecStorageWriter(str(tmp_path / "s0"), incremental=True)
    dcp.save(state, storage_writer=first, planner=_cached_planner(), no_dist=True)
    url = str(tmp_path / "s1")
    writer = FsspecStorageWriter(url, base=str(tmp_path / "s0"))
    with pytest.raises(CheckpointException) as raised:
        dcp.save(state, storage_writer=writer, planner=_cached_planner(), no_dist=True)
    (error, _), *_ = raised.value.failures.values()
    assert isinstance(error, UsageError) and url in str(error)
    assert not (tmp_path / "s1").exists()
