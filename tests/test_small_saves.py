"""Small, frequent saves: a save costs a bounded number of requests, not requests per check.

Many runs checkpoint small states often (RL policies, LoRA adapters, the demo); there a save's
time is its round trips, not its bytes. These tests record every S3 request a
:class:`~dcp_fsspec.Checkpointer` save and load of a ~3 MiB state in four keys send to the moto
server, print the log (``pytest -s`` shows it), and bound their number.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec.asyn
import pytest
import s3fs
import torch

from dcp_fsspec import Checkpointer
from tests.conftest import Backend

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),
]

KEYS = ("model", "optim", "scheduler", "trainer")
# Seconds a gate waits for requests sent together; only a save that sends them one by one waits.
DEADLINE = 20.0
# What a save of a new iteration sends on S3: the pointer, the iteration's commit record and
# folder (one LIST of its prefix), its claim; per key a look for an old .metadata (another save's
# stays: the writer refuses before writing), the data file and .metadata; then the commit:
# the pointer (its version for the compare-and-swap), one listing, each key's .metadata (the
# save's token), the commit record and the pointer; then the commit record once more (on S3 no
# lock spans the record and the pointer: the save checks that no other took it over meanwhile).
SAVE_REQUESTS = 4 + 3 * len(KEYS) + 4 + len(KEYS) + 1
# What a load of the latest iteration sends: the pointer, the commit record, the iteration's
# listing (with every file's size: the preflight's look at the data files lists nothing again),
# each key's .metadata (read once: the token check's bytes serve the load) and its data file.
LOAD_REQUESTS = 3 + 2 * len(KEYS)
# The same, in round trips one after another (the requests of one round go out together):
# a save reads the pointer, the iteration's record and whether its folder exists at once, claims
# it; writes every key at once (looks for an old .metadata, writes the data file,
# then .metadata); reads the pointer, the listing and every .metadata at once; writes the commit
# record, then the pointer; reads the commit record again.
SAVE_ROUNDS = 1 + 1 + 3 + 1 + 1 + 1 + 1
# Retention (keep_last_n) in that save: the listing of save_dirname goes with the save's first
# questions and the newest N commit records with its claim, so after the commit only the oldest
# iteration's record is deleted (uncommitted first). Then, on a thread of its own while training
# goes on: its folder's listing and its unfinished uploads at once; its files deleted.
RETENTION_ROUNDS_IN_SAVE = 1
RETENTION_ROUNDS = RETENTION_ROUNDS_IN_SAVE + 1 + 1
# A load reads the pointer; the commit record; the listing and every key's .metadata at once;
# every key's data file at once.
LOAD_ROUNDS = 1 + 1 + 1 + 1
# How long each request waits before it is sent, in the test of round trips: far longer than
# starting the threads that send requests together takes, so that those start in one round.
ROUND_DELAY = 0.25


class Gate:
    """Holds requests until ``width`` of them are waiting together, then lets them all through.

    Requests that are sent one after another never fill the gate: each waits ``DEADLINE`` and
    then goes through alone, and :attr:`batches` shows it (a 1 where a ``width`` belongs).
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self.batches: list[int] = []
        self._open: asyncio.Event | None = None
        self._waiting = 0

    async def through(self) -> None:
        if self._open is None:
            self._open, self._waiting = asyncio.Event(), 0
        event = self._open
        self._waiting += 1
        if self._waiting == self.width:
            self._release()
            return
        try:
            await asyncio.wait_for(event.wait(), DEADLINE)
        except asyncio.TimeoutError:
            if self._open is event:
                self._release()

    def _release(self) -> None:
        assert self._open is not None
        self.batches.append(self._waiting)
        self._open.set()
        self._open = None


@dataclass
class RequestLog:
    """Every S3 API call made while the test runs, as ``"operation key"``, in order; requests
    that a gate's predicate picks wait at that gate (s3fs sends them all from one event loop).

    With a ``delay``, every request waits that long before it is sent, and is numbered with the
    round trip it belongs to: one more than the highest round of the requests that had finished
    when it started. Requests sent together share a round; one that waited for another's answer
    is a round later. So the highest round is the number of round trips one after another.
    """

    lines: list[str] = field(default_factory=list)
    gates: list[tuple[Callable[[str], bool], Gate]] = field(default_factory=list)
    delay: float = 0.0
    rounds: list[int] = field(default_factory=list)
    finished_round: int = 0

    def clear(self) -> None:
        self.lines.clear()
        self.rounds.clear()
        self.finished_round = 0


@pytest.fixture
def request_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[RequestLog]:
    log = RequestLog()
    real = s3fs.S3FileSystem._call_s3

    async def logging_call(self: s3fs.S3FileSystem, method: str, *args: Any, **kwargs: Any) -> Any:
        line = f"{method} {kwargs.get('Key', kwargs.get('Prefix', ''))}"
        log.lines.append(line)
        round_ = log.finished_round + 1
        log.rounds.append(round_)
        for picks, gate in log.gates:
            if picks(line):
                await gate.through()
        await asyncio.sleep(log.delay)
        try:
            return await real(self, method, *args, **kwargs)
        finally:
            log.finished_round = max(log.finished_round, round_)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", logging_call)
    # s3fs's blocking call_s3 wraps the original _call_s3 (made at import): it is logged too.
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", fsspec.asyn.sync_wrapper(logging_call))
    yield log


def _small_state(step: int) -> dict[str, dict[str, Any]]:
    """~3 MiB over four keys, as a small policy's training state would be."""
    torch.manual_seed(step)
    return {
        "model": {"w": torch.randn(512, 1024), "b": torch.randn(1024)},  # 2 MiB
        "optim": {"m": torch.randn(256, 1024), "step": step},  # 1 MiB
        "scheduler": {"last_epoch": step, "lr": 1e-3},
        "trainer": {"step": step, "rng": torch.randint(0, 255, (1024,), dtype=torch.uint8)},
    }


def _show(what: str, log: list[str]) -> None:
    print(f"\n{what}: {len(log)} requests")
    for line in log:
        print("  " + line)


def test_a_small_save_and_load_cost_a_bounded_number_of_requests(
    s3_backend: Backend, request_log: RequestLog
) -> None:
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        ckpt.save(1, **_small_state(1))
        request_log.clear()
        ckpt.save(2, **_small_state(2))
        saved = list(request_log.lines)
        _show("save", saved)
    request_log.clear()
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        state = _small_state(0)
        assert ckpt.load(**state) == 2
        loaded = list(request_log.lines)
        _show("load", loaded)
    assert torch.equal(state["model"]["w"], _small_state(2)["model"]["w"])
    assert len(saved) <= SAVE_REQUESTS, saved
    assert len(loaded) <= LOAD_REQUESTS, loaded
    # The pointer: read at the preparation, and once more for the compare-and-swap that moves it.
    assert saved.count("get_object ckpt/latest_checkpoint.txt") == 2, saved


def test_a_small_save_and_load_are_a_bounded_number_of_round_trips_one_after_another(
    s3_backend: Backend, request_log: RequestLog
) -> None:
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        ckpt.save(1, **_small_state(1))
        request_log.clear()
        request_log.delay = ROUND_DELAY
        ckpt.save(2, **_small_state(2))
        saved = list(zip(request_log.rounds, request_log.lines, strict=True))
        request_log.clear()
        state = _small_state(0)
        assert ckpt.load(**state) == 2
        loaded = list(zip(request_log.rounds, request_log.lines, strict=True))
    _show("save, by round trip", [f"{r} {line}" for r, line in saved])
    _show("load, by round trip", [f"{r} {line}" for r, line in loaded])
    assert torch.equal(state["model"]["w"], _small_state(2)["model"]["w"])
    assert max(r for r, _ in saved) <= SAVE_ROUNDS, saved
    assert max(r for r, _ in loaded) <= LOAD_ROUNDS, loaded


def test_retention_after_a_small_save_is_a_bounded_number_of_round_trips(
    s3_backend: Backend, request_log: RequestLog
) -> None:
    with Checkpointer(s3_backend.url, s3_backend.storage_options, keep_last_n=2) as ckpt:
        ckpt.save(1, **_small_state(1))
        ckpt.save(2, **_small_state(2))
        request_log.clear()
        request_log.delay = ROUND_DELAY
        ckpt.save(3, **_small_state(3))
        in_save = max(request_log.rounds)  # the deletion's own thread may have begun
        ckpt.wait()
        saved = list(zip(request_log.rounds, request_log.lines, strict=True))
        assert ckpt.committed_iterations() == [2, 3]
    _show("save with retention, by round trip", [f"{r} {line}" for r, line in saved])
    assert in_save <= SAVE_ROUNDS + RETENTION_ROUNDS_IN_SAVE + 1, saved
    assert max(r for r, _ in saved) <= SAVE_ROUNDS + RETENTION_ROUNDS, saved


def test_a_small_save_on_one_rank_writes_its_keys_at_once(
    s3_backend: Backend, request_log: RequestLog
) -> None:
    data_files = Gate(len(KEYS))
    request_log.gates.append(
        (lambda line: line.startswith("put_object") and line.endswith(".distcp"), data_files)
    )
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        ckpt.save(1, **_small_state(1))
        state = _small_state(0)
        assert ckpt.load(**state) == 1
    assert data_files.batches == [len(KEYS)], request_log.lines
    assert torch.equal(state["optim"]["m"], _small_state(1)["optim"]["m"])


def test_a_commit_reads_every_keys_metadata_at_once(s3_backend: Backend, request_log: RequestLog) -> None:
    commit_reads = Gate(len(KEYS))

    def every_key_written() -> bool:
        return sum(
            line.startswith("put_object") and line.endswith("/.metadata") for line in request_log.lines
        ) == len(KEYS)

    # Each key's .metadata, read at the commit to check the save's token (after every key was
    # written: the writer's look for an old one is a GET of the same name).
    request_log.gates.append(
        (
            lambda line: (
                line.startswith("get_object") and line.endswith("/.metadata") and every_key_written()
            ),
            commit_reads,
        )
    )
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        ckpt.save(1, **_small_state(1))
        assert ckpt.committed_iterations() == [1]
    assert commit_reads.batches == [len(KEYS)], request_log.lines


def test_a_put_waits_for_the_servers_go_ahead_only_when_its_body_is_large(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore sends ``Expect: 100-continue`` with every streamed body: a round trip more per
    PUT. A small save's PUTs go without it; a body of EXPECT_CONTINUE_FROM bytes or more keeps it."""
    from aiobotocore.httpsession import AIOHTTPSession

    from dcp_fsspec.storage.backends.s3_client import EXPECT_CONTINUE_FROM

    sent: list[tuple[str, int, bytes | None]] = []
    real_send = AIOHTTPSession.send

    async def recording_send(self: AIOHTTPSession, request: Any) -> Any:
        if request.method == "PUT":
            name = "/".join(request.url.split("?")[0].split("/")[-2:])  # key/file
            expect = request.headers.get("Expect")  # bytes, as botocore keeps it
            expect = expect.encode() if isinstance(expect, str) else expect
            sent.append((name, int(request.headers.get("Content-Length") or 0), expect))
        return await real_send(self, request)

    monkeypatch.setattr(AIOHTTPSession, "send", recording_send)
    large = torch.zeros(EXPECT_CONTINUE_FROM // 4 + 1024)  # one data file just over the bound
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        ckpt.save(1, **_small_state(1))
        ckpt.save(2, **_small_state(2), big={"t": large})
    small = [(name, n, expect) for name, n, expect in sent if n < EXPECT_CONTINUE_FROM]
    big = [(name, n, expect) for name, n, expect in sent if n >= EXPECT_CONTINUE_FROM]
    assert len(small) >= 2 * (2 * len(KEYS) + 3), sent  # data files, .metadata, claim, record, pointer
    assert all(expect is None for _, _, expect in small), small
    assert len(big) == 1 and big[0][0].startswith("big/") and big[0][2] == b"100-continue", big


def _count_threads_and_hand_offs(
    monkeypatch: pytest.MonkeyPatch, roles: tuple[str, ...]
) -> tuple[list[str], list[str]]:
    """From now on: the names of the threads of ``roles`` started, and of every call handed to a
    thread pool (ours or any other)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    started: list[str] = []
    handed: list[str] = []
    real_start, real_submit = threading.Thread.start, ThreadPoolExecutor.submit

    def counting_start(self: threading.Thread) -> None:
        if any(self.name.startswith(f"dcp-fsspec-{role}") for role in roles):
            started.append(self.name)
        real_start(self)

    def counting_submit(self: ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        handed.append(getattr(fn, "__qualname__", repr(fn)))
        return real_submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    monkeypatch.setattr(ThreadPoolExecutor, "submit", counting_submit)
    return started, handed


def test_small_loads_on_local_disk_run_on_the_calling_thread(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small local load is a few milliseconds, and no round trip to hide: handing its reads,
    checks and keys to other threads (and the GIL back and forth) took half of it. It starts no
    thread and hands nothing to one."""
    with Checkpointer(str(tmp_path), {}) as ckpt:
        ckpt.save(1, **_small_state(1))
        started, handed = _count_threads_and_hand_offs(monkeypatch, ("read", "fetch", "crc", "at-once"))
        for _ in range(5):
            state = _small_state(0)
            assert ckpt.load(**state) == 1
            assert torch.equal(state["model"]["w"], _small_state(1)["model"]["w"])
    assert started == [] and handed == [], (started, handed)


def test_loads_reuse_their_threads(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a load uses threads (a remote store, or a bigger state here), its read, fetch and
    checksum threads are the storage layer's pools, kept between loads: over many loads they
    start fewer threads than there are loads (the pools' sizes bound them)."""
    from dcp_fsspec.storage.read import reader
    from dcp_fsspec.storage.transport import workers

    monkeypatch.setattr(workers, "_pools", {})  # fresh pools: earlier tests' threads do not count
    monkeypatch.setattr(reader, "_ON_THIS_THREAD_MAX", 0)  # every load on threads
    loads = 40
    pools = {"read": 16, "fetch": 16, "crc": reader._CHECKSUM_THREADS}
    assert sum(pools.values()) < loads  # else the bound below could not tell kept pools from new ones
    started, _ = _count_threads_and_hand_offs(monkeypatch, tuple(pools))
    with Checkpointer(str(tmp_path), {}) as ckpt:
        ckpt.save(1, **_small_state(1))
        for _ in range(loads):
            state = _small_state(0)
            assert ckpt.load(**state) == 1
            assert torch.equal(state["model"]["w"], _small_state(1)["model"]["w"])
    assert 0 < len(started) < loads, started


def test_a_load_parses_each_keys_metadata_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit's token check parses every key's ``.metadata``; the load's readers take the
    parsed result rather than parsing the bytes again (on one rank, where rank 0's reads serve)."""
    from dcp_fsspec.checkpoint.load import preflight
    from dcp_fsspec.storage.format import metadata_file

    parsed: list[str] = []
    real = metadata_file.parse_metadata

    def counting(raw: bytes, url: str, **kwargs: Any) -> Any:
        parsed.append(url)
        return real(raw, url, **kwargs)

    with Checkpointer(str(tmp_path), {}) as ckpt:
        ckpt.save(1, **_small_state(1))
        monkeypatch.setattr(
            metadata_file, "parse_metadata", counting
        )  # the token check's, imported when called
        monkeypatch.setattr(preflight, "parse_metadata", counting)  # the readers'
        state = _small_state(0)
        assert ckpt.load(**state) == 1
    assert torch.equal(state["model"]["w"], _small_state(1)["model"]["w"])
    assert sorted(parsed) == sorted(str(tmp_path / "iter_000000001" / key / ".metadata") for key in KEYS)


def test_a_load_plans_each_key_once_and_restores_its_top_level_values(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preflight's plan of a key is the plan ``dcp.load`` runs: DCP's planning (flattening
    the state dict, matching it against ``.metadata``) happens once a key, not twice. Values at
    a key's top level (``step``, ``last_epoch``) still come back: ``dcp.load`` hands its planner
    a copy of the top level, and takes them from there."""
    from torch.distributed.checkpoint import default_planner

    planned: list[int] = []
    real = default_planner.create_default_local_load_plan

    def counting(*args: Any, **kwargs: Any) -> Any:
        planned.append(1)
        return real(*args, **kwargs)

    with Checkpointer(str(tmp_path), {}) as ckpt:
        ckpt.save(7, **_small_state(7))
        monkeypatch.setattr(default_planner, "create_default_local_load_plan", counting)
        state = _small_state(0)
        assert ckpt.load(**state) == 7
    assert len(planned) == len(KEYS)
    saved = _small_state(7)
    assert state["optim"]["step"] == state["scheduler"]["last_epoch"] == state["trainer"]["step"] == 7
    assert torch.equal(state["optim"]["m"], saved["optim"]["m"]) and torch.equal(
        state["trainer"]["rng"], saved["trainer"]["rng"]
    )
