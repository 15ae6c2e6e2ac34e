"""Two tiers: save to local disk first, drain to the durable URL (real moto S3) in the background.

Each test states one guarantee of ``Checkpointer(..., local_tier=LocalTier(...))``: the durable pointer
moves only after the durable copy is committed; a drain killed part-way leaves the durable
pointer on the previous iteration and the next run resumes the newer local copy and drains it
again; an unreachable durable URL never stops the local saves, and a later drain catches up;
resuming reads the nearest copy every rank can read, and a damaged local copy falls back.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_fsspec import (
    Checkpointer,
    CheckpointNotFoundError,
    DrainError,
    FsspecStorageReader,
    LocalTier,
    RetryPolicy,
)
from dcp_fsspec.checkpoint.commit import committing, deletion, pointer, retention, run_listing
from dcp_fsspec.checkpoint.commit.commit_record import read_commit_record
from dcp_fsspec.checkpoint.options import DRAIN_LATEST
from dcp_fsspec.checkpoint.tiers import drain
from dcp_fsspec.checkpoint.tiers.drain_thread import Drainer
from dcp_fsspec.checkpoint.tiers.metadata_merge import merge_metadata, rank_file_name
from dcp_fsspec.checkpoint.tiers.tiered import DURABLE, LOCAL, choose_tier, one_save_everywhere
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, POINTER_NAME
from dcp_fsspec.storage.transport.urls import resolve
from dcp_fsspec.tools import targets
from tests.ckpt_fsdp import FsdpTraining, assert_same_full_state
from tests.ckpt_helpers import Training, assert_same_training
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.faults import FaultyProxy
from tests.servers.counting import CountingProxy

pytestmark = pytest.mark.timeout(240)

# Few retries, so a durable URL that is down fails its drain in seconds.
_QUICK = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, deadline=30.0)


def _pointer(url: str, options: dict[str, Any]) -> int | None:
    return pointer.read_pointer(resolve(url, options))


def _trained(steps: int) -> Training:
    training = Training()
    training.run(steps)
    return training


def _resume(
    url: str, options: dict[str, Any], local: Path, *, keep_last_n_local: int = 1
) -> tuple[int, Training]:
    fresh = Training(seed=7)
    with Checkpointer(url, options, local_tier=LocalTier(local, keep_last_n=keep_last_n_local)) as ckpt:
        iteration = ckpt.load(**fresh.keys())
    fresh.after_load()
    return iteration, fresh


def test_a_save_commits_locally_and_the_durable_pointer_moves_once_the_drain_is_committed(
    s3_backend: Backend, tmp_path: Path
) -> None:
    events: list[Any] = []
    training = _trained(2)
    with Checkpointer(
        s3_backend.url,
        s3_backend.storage_options,
        local_tier=LocalTier(tmp_path / "local"),
        on_event=lambda e: events.append(e) if e.kind in ("save_end", "drain_end") else None,
    ) as ckpt:
        ckpt.save(2, **training.keys())
        assert _pointer(str(tmp_path / "local"), {}) == 2  # save() returned: committed locally
        ckpt.wait()
        assert ckpt.latest_checkpoint() == "iter_000000002" and ckpt.committed_iterations() == [2]
    assert [(e.kind, e.tier, e.iteration) for e in events] == [
        ("save_end", LOCAL, 2),
        ("drain_end", DURABLE, 2),
    ]
    assert events[1].error is None and events[1].nbytes > 0 and events[1].url.startswith(s3_backend.url)
    iteration, resumed = _resume(s3_backend.url, s3_backend.storage_options, tmp_path / "fresh-machine")
    assert iteration == 2
    assert_same_training(resumed, training)


# A training process killed during its second drain: it saves iterations 2 and 4 (2 steps each),
# and stops its drain thread at a known point (every file of iteration 4 copied to the durable
# tier, its commit not yet written) through a log handler, which creates the marker file and
# blocks until the test SIGKILLs the process.
_KILLED_CHILD = """
import json, logging, sys, threading
from pathlib import Path
from dcp_fsspec import Checkpointer, LocalTier
from tests.ckpt_helpers import Training

url, options, local, marker = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], Path(sys.argv[4])

class StopBeforeTheDurableCommit(logging.Handler):
    def handle(self, record):  # not emit, which holds the handler's lock
        if record.getMessage().startswith("copied") and "iter_000000004" in record.getMessage():
            marker.touch()
            threading.Event().wait()
        return True

drain_log = logging.getLogger("dcp_fsspec.checkpoint.tiers.drain")
drain_log.setLevel(logging.DEBUG)
drain_log.addHandler(StopBeforeTheDurableCommit())
training = Training()
ckpt = Checkpointer(url, options, local_tier=LocalTier(local, keep_last_n=2))
for it in (2, 4):
    training.run(2)
    ckpt.save(it, **training.keys())
    if it == 2:
        ckpt.wait()
threading.Event().wait(600)
"""


def test_a_drain_killed_part_way_leaves_the_durable_pointer_and_the_next_run_resumes_locally_and_drains_again(
    s3_backend: Backend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local, marker = tmp_path / "local", tmp_path / "stopped-before-the-durable-commit"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _KILLED_CHILD,
            s3_backend.url,
            json.dumps(s3_backend.storage_options),
            str(local),
            str(marker),
        ],
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert time.monotonic() < deadline and child.poll() is None, "the drain never reached its commit"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()

    fs = fsspec.filesystem("s3", **s3_backend.storage_options)
    durable_files = fs.find(s3_backend.url + "/iter_000000004")
    assert any(name.endswith(".distcp") for name in durable_files)  # the copy was under way
    assert _pointer(s3_backend.url, s3_backend.storage_options) == 2  # ... and not committed
    assert 4 not in run_listing.committed_iterations(resolve(s3_backend.url, s3_backend.storage_options))

    with caplog.at_level(logging.INFO, logger="dcp_fsspec"):
        iteration, resumed = _resume(s3_backend.url, s3_backend.storage_options, local, keep_last_n_local=2)
    assert iteration == 4 and "(local tier)" in caplog.text
    assert_same_training(resumed, _trained(4))
    # Loading the local-only iteration drained it again (finalize waited): the durable tier caught up.
    assert _pointer(s3_backend.url, s3_backend.storage_options) == 4
    iteration, from_durable = _resume(s3_backend.url, s3_backend.storage_options, tmp_path / "fresh-machine")
    assert iteration == 4
    assert_same_training(from_durable, _trained(4))


def test_an_unreachable_durable_url_never_stops_local_saves_and_the_next_drain_catches_up(
    s3_server: LocalS3Server, s3_backend: Backend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with FaultyProxy(s3_server.endpoint_url) as proxy:
        # botocore's own retries off too: the server is down for good.
        options = {
            **s3_backend.storage_options,
            "client_kwargs": {"endpoint_url": proxy.endpoint_url},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 5, "read_timeout": 60},
        }
        local = tmp_path / "local"
        training = Training()
        ckpt = Checkpointer(s3_backend.url, options, local_tier=LocalTier(local), retry=_QUICK)
        try:
            training.run(1)
            ckpt.save(1, **training.keys())
            ckpt.wait()
            with proxy.faults_at(1.0, ("drop",)):  # the server is down
                training.run(1)
                ckpt.save(2, **training.keys())  # does not raise
                with pytest.raises(DrainError) as raised:
                    ckpt.wait()
                assert f"{s3_backend.url}/iter_000000002" in str(raised.value)
                training.run(1)
                with caplog.at_level(logging.WARNING, logger="dcp_fsspec"):
                    ckpt.save(3, **training.keys())  # still does not raise; warns
                warning = next(r.getMessage() for r in caplog.records if "is behind" in r.getMessage())
                assert s3_backend.url in warning and str(local) in warning
                assert _pointer(str(local), {}) == 3
                with pytest.raises(DrainError):
                    ckpt.wait()
            assert _pointer(s3_backend.url, options) == 1  # the durable tier is behind
            training.run(1)
            ckpt.save(4, **training.keys())  # the server is back: this drain catches up
            ckpt.wait()
            assert _pointer(s3_backend.url, options) == 4
        finally:
            try:
                ckpt.finalize()
            except DrainError:
                pass
    iteration, resumed = _resume(s3_backend.url, s3_backend.storage_options, tmp_path / "fresh-machine")
    assert iteration == 4
    assert_same_training(resumed, training)


def test_a_fresh_machine_resumes_from_the_durable_tier_bit_exact(
    s3_backend: Backend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    training = Training()
    with Checkpointer(
        s3_backend.url, s3_backend.storage_options, local_tier=LocalTier(tmp_path / "node-a")
    ) as ckpt:
        for it in (1, 2):
            training.run(1)
            ckpt.save(it, **training.keys())
    with caplog.at_level(logging.INFO, logger="dcp_fsspec"):
        iteration, resumed = _resume(s3_backend.url, s3_backend.storage_options, tmp_path / "node-b")
    assert iteration == 2 and "(durable tier)" in caplog.text and s3_backend.url in caplog.text
    assert_same_training(resumed, training)


def test_a_damaged_local_copy_falls_back_to_the_durable_tier_with_a_warning(
    s3_backend: Backend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "local"
    training = _trained(3)
    with Checkpointer(s3_backend.url, s3_backend.storage_options, local_tier=LocalTier(local)) as ckpt:
        ckpt.save(3, **training.keys())
    shard = next((local / "iter_000000003" / "model").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    at = data.find(training.model[0].weight.detach().numpy().tobytes())
    assert at > 0
    data[at + 8] ^= 0x01  # one flipped bit in the weights
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="dcp_fsspec"):
        iteration, resumed = _resume(s3_backend.url, s3_backend.storage_options, local)
    assert iteration == 3
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING and "damaged" in r.getMessage())
    assert str(local) in warning.getMessage() and s3_backend.url in warning.getMessage()
    assert "(durable tier)" in caplog.text
    assert_same_training(resumed, training)


def test_the_tier_decision_takes_the_newest_iteration_every_rank_can_read() -> None:
    assert choose_tier(4, [{4, 6}, {6}]) == (6, LOCAL)  # local newer than durable, on every rank
    assert choose_tier(4, [{4, 6}, set()]) == (4, DURABLE)  # one rank's local disk is gone
    assert choose_tier(6, [{4}, {4}]) == (6, DURABLE)  # the durable tier is newer
    assert choose_tier(None, [set()]) is None
    assert choose_tier(6, [{4}, {4, 6}], iteration=4) == (4, LOCAL)
    assert choose_tier(6, [{6}, {4}], iteration=6) == (6, DURABLE)


def test_a_local_iteration_counts_only_where_every_rank_holds_the_same_save_of_it() -> None:
    # Node 1 kept an iteration 6 of another run (another token): 6 is nobody's to resume locally.
    assert one_save_everywhere([{4: "a", 6: "b"}, {4: "a", 6: "c"}]) == [{4}, {4}]
    assert one_save_everywhere([{4: "a", 6: "b"}, {4: "a"}]) == [{4}, {4}]
    assert one_save_everywhere([{4: None}, {4: None}]) == [{4}, {4}]  # records from before tokens
    assert choose_tier(None, one_save_everywhere([{4: "a", 6: "b"}, {4: "a", 6: "c"}])) == (4, LOCAL)


def _two_ranks_save(
    rank: int, world_size: int, url: str, options: dict[str, Any], local: str, out: str
) -> None:
    """Save iterations 1 (drained) and 2 (local only: its drain is undone, as if killed), each
    rank into its own ``local`` folder (``{rank}`` filled in)."""
    torch.manual_seed(0)
    state = {"w": torch.randn(64)}
    with Checkpointer(url, options, local_tier=LocalTier(local.format(rank=rank), keep_last_n=2)) as ckpt:
        ckpt.save(1, trainer={"w": state["w"]})
        ckpt.wait()
        ckpt.save(2, trainer={"w": state["w"] * 2})
        ckpt.wait()
        if rank == 0:  # undo the durable copy of 2: the state a drain killed part-way leaves
            root = resolve(url, options)
            deletion.discard_iterations(root, [2])
            committing.write_atomically(root, root.join(POINTER_NAME), b"iter_000000001\n")
    torch.save(state, f"{out}.{rank}")


def _two_ranks_load(
    rank: int, world_size: int, url: str, options: dict[str, Any], locals_: list[str], out: str
) -> None:
    """Resume, each rank with its own ``local_dirname``, and save the next iteration again (rank
    0's local tier had an older copy of it)."""
    target = {"w": torch.zeros(64)}
    with Checkpointer(url, options, local_tier=LocalTier(locals_[rank])) as ckpt:
        iteration = ckpt.load(trainer=target)
        torch.save({"iteration": iteration, "w": target["w"].clone()}, f"{out}.{rank}")
        ckpt.save(iteration + 1, trainer={"w": target["w"] * 3})


@pytest.mark.slow
def test_two_ranks_with_one_local_folder_wiped_both_resume_the_same_iteration_from_the_durable_tier(
    s3_backend: Backend, tmp_path: Path
) -> None:
    node0, node1, rank0_tier = (
        str(tmp_path / "node-0"),
        str(tmp_path / "node-1"),
        str(tmp_path / "node-0" / "rank0"),
    )
    saved = str(tmp_path / "saved")
    run_ranks(
        _two_ranks_save,
        2,
        tmp_path,
        s3_backend.url,
        s3_backend.storage_options,
        str(tmp_path / "node-{rank}"),
        saved,
    )
    assert _pointer(s3_backend.url, s3_backend.storage_options) == 1 and _pointer(rank0_tier, {}) == 2
    shutil.rmtree(node1)
    loaded = str(tmp_path / "loaded")
    # Rank 0 still has iterations 1 and 2 locally; rank 1's local folder is empty.
    run_ranks(
        _two_ranks_load, 2, tmp_path, s3_backend.url, s3_backend.storage_options, [node0, node1], loaded
    )
    for rank in (0, 1):
        result = torch.load(f"{loaded}.{rank}")
        assert result["iteration"] == 1, f"rank {rank} resumed {result['iteration']}"
        assert torch.equal(result["w"], torch.load(f"{saved}.{rank}")["w"])  # iteration 1's, not 2's
    # Training went on from 1 and saved 2 again: the local tier dropped its stale 2 and took it.
    assert _pointer(s3_backend.url, s3_backend.storage_options) == 2 and _pointer(rank0_tier, {}) == 2


def test_async_saves_drain_after_their_local_commit(s3_backend: Backend, tmp_path: Path) -> None:
    training = Training()
    with Checkpointer(
        s3_backend.url,
        s3_backend.storage_options,
        local_tier=LocalTier(tmp_path / "local"),
        async_mode="async_with_pinned_mem",
    ) as ckpt:
        for it in (1, 2):
            training.run(1)
            ckpt.save(it, **training.keys())
        ckpt.wait()
        assert ckpt.committed_iterations() == [1, 2] and ckpt.latest_checkpoint() == "iter_000000002"
    iteration, resumed = _resume(s3_backend.url, s3_backend.storage_options, tmp_path / "fresh-machine")
    assert iteration == 2
    assert_same_training(resumed, training)


class _HoldDrain(logging.Handler):
    """Blocks the drain thread when it starts copying ``iteration``, until released."""

    def __init__(self, iteration: int) -> None:
        super().__init__()
        self.folder = f"iter_{iteration:09d}"
        self.reached = threading.Event()
        self.release = threading.Event()

    def handle(self, record: logging.LogRecord) -> bool:  # not emit: that runs under the handler's lock
        if record.getMessage().startswith("draining") and self.folder in record.getMessage():
            self.reached.set()
            self.release.wait(120)
        return True


def test_drain_every_holds_the_next_save_until_the_drain_in_flight_is_done_and_every_iteration_goes_up(
    s3_backend: Backend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "local"
    hold = _HoldDrain(1)
    drain_log = logging.getLogger("dcp_fsspec.checkpoint.tiers.drain")
    drain_log.addHandler(hold)
    try:
        with (
            caplog.at_level(logging.INFO, logger="dcp_fsspec"),
            Checkpointer(
                s3_backend.url, s3_backend.storage_options, local_tier=LocalTier(local, keep_last_n=1)
            ) as ckpt,
        ):
            ckpt.save(1, trainer={"w": torch.ones(4)})
            assert hold.reached.wait(60)
            second = threading.Thread(
                target=ckpt.save, args=(2,), kwargs={"trainer": {"w": torch.ones(4) * 2}}
            )
            second.start()
            second.join(1.0)
            assert second.is_alive()  # save(2) waits for the drain of 1 ...
            # ... with 2 committed locally, and 1 (in flight) not yet let go of by local retention
            assert sorted(p.name for p in local.glob("iter_*")) == ["iter_000000001", "iter_000000002"]
            assert _pointer(str(local), {}) == 2 and ckpt.committed_iterations() == []
            hold.release.set()
            second.join(60)
            assert not second.is_alive()
            ckpt.save(3, trainer={"w": torch.ones(4) * 3})
            ckpt.wait()
            assert ckpt.committed_iterations() == [1, 2, 3]
    finally:
        hold.release.set()
        drain_log.removeHandler(hold)


def test_drain_latest_replaces_a_waiting_iteration_and_local_retention_keeps_the_one_in_flight(
    s3_backend: Backend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "local"
    hold = _HoldDrain(1)
    drain_log = logging.getLogger("dcp_fsspec.checkpoint.tiers.drain")
    drain_log.addHandler(hold)
    try:
        with (
            caplog.at_level(logging.INFO, logger="dcp_fsspec"),
            Checkpointer(
                s3_backend.url,
                s3_backend.storage_options,
                local_tier=LocalTier(local, drain="latest", keep_last_n=1),
            ) as ckpt,
        ):
            ckpt.save(1, trainer={"w": torch.ones(4)})
            assert hold.reached.wait(60)
            ckpt.save(2, trainer={"w": torch.ones(4) * 2})  # waits behind the drain of 1
            ckpt.save(3, trainer={"w": torch.ones(4) * 3})  # replaces 2, which never goes up
            local_now = sorted(p.name for p in local.glob("iter_*"))
            assert local_now == ["iter_000000001", "iter_000000003"]  # 1 is in flight, 3 the newest
            hold.release.set()
            ckpt.wait()
            assert ckpt.committed_iterations() == [1, 3]
        assert "iter_000000002 is replaced by iter_000000003" in caplog.text
    finally:
        hold.release.set()
        drain_log.removeHandler(hold)


def _committed_locally(local: Path, iteration: int) -> None:
    """Save ``iteration`` under ``local`` (its own drain goes to another durable folder)."""
    with Checkpointer(local.parent / "other-durable", local_tier=LocalTier(local)) as ckpt:
        ckpt.save(iteration, **_trained(1).keys())


def test_rank0_commits_the_durable_copy_only_once_every_other_rank_marked_its_files_of_this_save(
    tmp_path: Path,
) -> None:
    local, durable = tmp_path / "local", resolve(str(tmp_path / "durable"), {})
    _committed_locally(local, 3)
    token = read_commit_record(resolve(str(local), {}), 3).save_id  # type: ignore[union-attr]
    job = drain.DrainJob(3, token)
    local_root = resolve(str(local), {})

    def drain_as_rank0_of_two() -> None:
        drain.drain_iteration(
            local_root, durable, job, rank=0, world_size=2, keep_last_n=None, marker_wait=0.5
        )

    with pytest.raises(DrainError) as raised:  # rank 1 never copied its files
        drain_as_rank0_of_two()
    assert "rank(s) [1]" in str(raised.value) and str(tmp_path / "durable" / "iter_000000003") in str(
        raised.value
    )
    marker = tmp_path / "durable" / "iter_000000003" / drain.marker_name(1)
    marker.write_bytes(b"another-save")  # a marker left by a drain of another save of iteration 3
    with pytest.raises(DrainError):
        drain_as_rank0_of_two()
    assert pointer.read_pointer(durable) is None  # nothing was committed
    marker.write_bytes(token.encode())
    drain_as_rank0_of_two()
    assert pointer.read_pointer(durable) == 3 and not marker.exists()  # committed; the marker is gone


def test_the_drain_copies_neither_claim_of_a_local_iteration_its_name_nor_an_earlier_versions(
    tmp_path: Path,
) -> None:
    local, durable = tmp_path / "local", resolve(str(tmp_path / "durable"), {})
    _committed_locally(local, 3)
    local_root = resolve(str(local), {})
    token = read_commit_record(local_root, 3).save_id  # type: ignore[union-attr]
    (local / "iter_000000003" / committing.LEGACY_CLAIM_NAME).write_text(
        token
    )  # as an earlier version named it
    drain.drain_iteration(local_root, durable, drain.DrainJob(3, token), keep_last_n=None)
    assert pointer.read_pointer(durable) == 3
    names = {p.name for p in (tmp_path / "durable" / "iter_000000003").iterdir()}
    assert (
        committing.CLAIM_NAME not in names
        and committing.LEGACY_CLAIM_NAME not in names
        and COMMIT_RECORD_NAME in names
    )


def test_a_durable_copy_is_made_only_of_a_committed_local_copy_of_the_same_save(tmp_path: Path) -> None:
    local, durable = tmp_path / "local", resolve(str(tmp_path / "durable"), {})
    _committed_locally(local, 3)
    local_root = resolve(str(local), {})
    token = read_commit_record(local_root, 3).save_id  # type: ignore[union-attr]
    folder, copy = str(local / "iter_000000003"), str(tmp_path / "durable" / "iter_000000003")
    # Per node, every rank's copy must be the save rank 0 drains (its token).
    with pytest.raises(DrainError, match="is another save's") as raised:
        drain.drain_iteration(
            local_root,
            durable,
            drain.DrainJob(3, "another-save"),
            rank=1,
            world_size=2,
            keep_last_n=None,
            per_node=True,
        )
    assert folder in str(raised.value) and copy in str(raised.value)
    (
        local / "iter_000000003" / COMMIT_RECORD_NAME
    ).unlink()  # as a save that died before its commit leaves it
    for rank in (0, 1):
        with pytest.raises(DrainError, match="a durable copy is only made of a committed one") as raised:
            drain.drain_iteration(
                local_root,
                durable,
                drain.DrainJob(3, token),
                rank=rank,
                world_size=2,
                keep_last_n=None,
                marker_wait=0.5,
                per_node=True,
            )
        assert folder in str(raised.value) and copy in str(raised.value)
    assert pointer.read_pointer(durable) is None and not (tmp_path / "durable" / "iter_000000003").exists()


def test_per_node_a_ranks_data_files_and_content_hashes_take_its_rank_in_their_durable_names() -> None:
    assert rank_file_name("model/__0_0.distcp", 3) == "model/__3_0.distcp"
    assert rank_file_name("model/.content_hashes.json", 3) == "model/__3.content_hashes.json"
    assert rank_file_name("model/.content_hashes.json", 0) == "model/.content_hashes.json"
    assert rank_file_name("model/.metadata", 3) == "model/.metadata"


def test_each_rank_copies_the_data_files_it_wrote_and_rank0_the_rest() -> None:
    names = [
        "model/__0_0.distcp",
        "model/__1_0.distcp",
        "model/__1_ab12_3.distcp",
        "model/.metadata",
        "optim/__2_0.distcp",
        "extra.txt",
    ]
    assert [drain.owner_of(n, world_size=2) for n in names] == [0, 1, 1, 0, 0, 0]  # rank 2 is no rank here
    assert [drain.owner_of(n, world_size=3) for n in names] == [0, 1, 1, 0, 2, 0]


def _own_metadata(first_row: int) -> Metadata:
    """A rank's own ``.metadata`` (saved without collectives): its two rows of ``w``, ``r`` and
    ``s`` whole (replicated), all in its ``__0_0.distcp``."""
    props = TensorProperties(dtype=torch.float32)
    return Metadata(
        {
            "w": TensorStorageMetadata(
                props,
                torch.Size([4, 2]),
                [ChunkStorageMetadata(torch.Size([first_row, 0]), torch.Size([2, 2]))],
            ),
            "r": TensorStorageMetadata(
                props, torch.Size([3]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([3]))]
            ),
            "s": BytesStorageMetadata(),
        },
        storage_data={
            MetadataIndex("w", [first_row, 0]): _StorageInfo("__0_0.distcp", 0, 16),
            MetadataIndex("r", [0]): _StorageInfo("__0_0.distcp", 16, 12),
            MetadataIndex("s"): _StorageInfo("__0_0.distcp", 28, 4),
        },
    )


def test_the_ranks_own_metadata_merge_into_one_with_each_chunk_once_in_its_ranks_file() -> None:
    merged = merge_metadata(
        [(1, _own_metadata(2)), (0, _own_metadata(0))], rename=rank_file_name, save_id="t", checkpoint_id="x"
    )
    w, r = merged.state_dict_metadata["w"], merged.state_dict_metadata["r"]
    assert isinstance(w, TensorStorageMetadata) and isinstance(r, TensorStorageMetadata)
    assert [list(c.offsets) for c in w.chunks] == [[0, 0], [2, 0]] and len(r.chunks) == 1
    files = {
        (index.fqn, tuple(index.offset or ())): info.relative_path
        for index, info in merged.storage_data.items()
    }
    assert files == {
        ("w", (0, 0)): "__0_0.distcp",
        ("w", (2, 0)): "__1_0.distcp",
        ("r", (0,)): "__0_0.distcp",
        ("s", ()): "__0_0.distcp",
    }
    assert merged.storage_meta is not None and merged.storage_meta.save_id == "t"
    clash = _own_metadata(0)
    clash.state_dict_metadata["r"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([3]),
        [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))],
    )
    with pytest.raises(ValueError, match="'r': rank 1"):
        merge_metadata(
            [(0, _own_metadata(0)), (1, clash)], rename=rank_file_name, save_id="t", checkpoint_id="x"
        )
    not_a_tensor = _own_metadata(2)
    not_a_tensor.state_dict_metadata["s"] = not_a_tensor.state_dict_metadata[
        "r"
    ]  # a tensor where rank 0 has bytes
    with pytest.raises(ValueError, match="'s': rank 1 wrote a tensor, a lower rank something else"):
        merge_metadata(
            [(0, _own_metadata(0)), (1, not_a_tensor)], rename=rank_file_name, save_id="t", checkpoint_id="x"
        )


def _own_folders_save(rank: int, world_size: int, url: str, base: str, out: str, scale: float = 1.0) -> None:
    """Each rank its own local_dirname (a node's own disk): save 1 to 3 (keeping one locally)
    with a sharded (times ``scale``) and a replicated tensor; rank 0 keeps its log."""
    log = logging.FileHandler(f"{out}.log")
    logging.getLogger("dcp_fsspec").addHandler(log)
    logging.getLogger("dcp_fsspec").setLevel(logging.INFO)
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(torch.arange(64.0).reshape(8, 8) * scale, mesh, [Shard(0)])
    with Checkpointer(url, local_tier=LocalTier(f"{base}/node-{rank}", keep_last_n=1)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, trainer={"w": sharded * step, "r": torch.full((3,), 5.0), "step": step})


def _load_whole(rank: int, world_size: int, url: str, base: str, out: str) -> None:
    """Load ``w`` whole on every rank (no sharding now): more than a rank's own local copy holds."""
    target = {"w": torch.zeros(8, 8), "r": torch.zeros(3), "step": 0}
    tiers: list[str | None] = []
    with Checkpointer(
        url,
        local_tier=LocalTier(f"{base}/node-{rank}"),
        on_event=lambda e: tiers.append(e.tier) if e.kind == "load_end" else None,
    ) as ckpt:
        iteration = ckpt.load(trainer=target)
    torch.save({"iteration": iteration, "tiers": tiers, **target}, f"{out}.{rank}")


@pytest.mark.slow
def test_each_rank_with_a_local_dirname_of_its_own_keeps_its_own_copy_and_a_copy_short_of_what_it_loads_reads_durable(
    tmp_path: Path,
) -> None:
    url, out = str(tmp_path / "durable"), str(tmp_path / "out")
    run_ranks(_own_folders_save, 2, tmp_path, url, str(tmp_path), out)
    assert "per-node mode: rank(s) [1] cannot see" in Path(f"{out}.log").read_text()
    for rank in (0, 1):  # each node's folder: that rank's own checkpoint, its own pointer and retention
        tier = tmp_path / f"node-{rank}" / f"rank{rank}"
        assert _pointer(str(tier), {}) == 3 and run_listing.committed_iterations(resolve(str(tier))) == [3]
        assert not (tmp_path / f"node-{rank}" / f"rank{1 - rank}").exists()
        with pytest.raises(
            CheckpointNotFoundError, match=f"per-node local_dirname .*give one of them, e.g. .*rank{rank}$"
        ):
            targets.classify(resolve(str(tmp_path / f"node-{rank}")))  # what every tool is given
        assert targets.classify(resolve(str(tier))).kind == "run"
    assert run_listing.committed_iterations(resolve(url)) == [1, 2, 3]
    # The durable copy: one plain checkpoint, each rank's shard in its own file, no drain leftovers.
    assert sorted(p.name for p in (tmp_path / "durable" / "iter_000000003" / "trainer").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    # Every rank now holds w whole; its local copy has only its half: both read the durable tier.
    loaded = str(tmp_path / "loaded")
    run_ranks(_load_whole, 2, tmp_path, url, str(tmp_path), loaded)
    for rank in (0, 1):
        result = torch.load(f"{loaded}.{rank}")
        assert result["iteration"] == 3 and result["tiers"] == [DURABLE], result
        assert torch.equal(result["w"], torch.arange(64.0).reshape(8, 8) * 3) and torch.equal(
            result["r"], torch.full((3,), 5.0)
        )
        assert result["step"] == 3


def _load_sharded(rank: int, world_size: int, url: str, base: str, out: str) -> None:
    """Load ``w`` sharded as saved; rank 0 keeps its log."""
    if rank == 0:
        logging.getLogger("dcp_fsspec").addHandler(logging.FileHandler(f"{out}.log"))
    mesh = init_device_mesh("cpu", (world_size,))
    target = {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)]), "r": torch.zeros(3), "step": 0}
    tiers: list[str | None] = []
    with Checkpointer(
        url,
        local_tier=LocalTier(f"{base}/node-{rank}"),
        on_event=lambda e: tiers.append(e.tier) if e.kind == "load_end" else None,
    ) as ckpt:
        iteration = ckpt.load(trainer=target)
    whole = target["w"].full_tensor()  # a collective
    torch.save(
        {"iteration": iteration, "tiers": tiers, "w": whole, "r": target["r"], "step": target["step"]},
        f"{out}.{rank}",
    )


@pytest.mark.slow
def test_a_damaged_local_copy_on_one_node_sends_every_rank_to_the_durable_tier_with_a_warning(
    tmp_path: Path,
) -> None:
    url, out = str(tmp_path / "durable"), str(tmp_path / "out")
    run_ranks(_own_folders_save, 2, tmp_path, url, str(tmp_path), out)
    shard = next((tmp_path / "node-1" / "rank1" / "iter_000000003" / "trainer").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    at = data.find((torch.arange(32.0, 64.0) * 3).numpy().tobytes())  # rank 1's half of w
    assert at > 0
    data[at + 8] ^= 0x01
    shard.write_bytes(bytes(data))
    loaded = str(tmp_path / "loaded")
    run_ranks(_load_sharded, 2, tmp_path, url, str(tmp_path), loaded)
    for rank in (0, 1):
        result = torch.load(f"{loaded}.{rank}")
        assert result["iteration"] == 3 and result["tiers"] == [DURABLE], result
        assert torch.equal(result["w"], torch.arange(64.0).reshape(8, 8) * 3) and result["step"] == 3
    warning = next(line for line in Path(f"{loaded}.log").read_text().splitlines() if "damaged" in line)
    assert str(shard.parent) in warning and url in warning, warning


@pytest.mark.slow
def test_a_node_that_rejoins_with_another_runs_copy_of_the_iteration_sends_every_rank_to_the_durable_tier(
    tmp_path: Path,
) -> None:
    # Node 1 was out of the job: it still holds iteration 3 as an earlier run saved it (other
    # values, another token), while the job saved 3 again without it. Both ranks read the
    # durable 3; neither mixes node 1's copy into it.
    stale, job = tmp_path / "stale", tmp_path / "job"
    stale.mkdir()
    job.mkdir()
    run_ranks(_own_folders_save, 2, tmp_path, str(stale / "durable"), str(stale), str(stale / "out"), 10.0)
    run_ranks(_own_folders_save, 2, tmp_path, str(job / "durable"), str(job), str(job / "out"))
    shutil.rmtree(job / "node-1")
    shutil.copytree(stale / "node-1", job / "node-1")
    assert _pointer(str(job / "node-1" / "rank1"), {}) == 3  # a committed, complete local 3, of the other run
    loaded = str(tmp_path / "loaded")
    run_ranks(_load_sharded, 2, tmp_path, str(job / "durable"), str(job), loaded)
    for rank in (0, 1):
        result = torch.load(f"{loaded}.{rank}")
        assert result["iteration"] == 3 and result["tiers"] == [DURABLE], result
        assert torch.equal(result["w"], torch.arange(64.0).reshape(8, 8) * 3) and result["step"] == 3


def _fsdp_training(seed: int) -> FsdpTraining:
    torch.set_num_threads(1)
    return FsdpTraining(init_device_mesh("cpu", (dist.get_world_size(),)), seed)


def _fsdp_save(rank: int, world_size: int, url: str, options: dict[str, Any], local: str, out: str) -> None:
    """FSDP2 training saves 2 and 4 (drained) and 6, whose durable copy is then undone (as a
    drain killed before its commit leaves it); rank 0 dumps the full state at each save.
    ``local`` may hold ``{rank}``: each rank its own folder."""
    training = _fsdp_training(0)
    with Checkpointer(url, options, local_tier=LocalTier(local.format(rank=rank), keep_last_n=3)) as ckpt:
        for iteration in (2, 4, 6):
            while training.trainer["step"] < iteration:
                training.step()
            ckpt.save(iteration, **training.keys())
            ckpt.wait()
            state = training.full_state()
            if rank == 0:
                torch.save(state, f"{out}.{iteration}")
        if rank == 0:
            root = resolve(url, options)
            deletion.discard_iterations(root, [6])
            committing.write_atomically(root, root.join(POINTER_NAME), b"iter_000000004\n")


def _fsdp_resume(
    rank: int, world_size: int, url: str, options: dict[str, Any], locals_: list[str] | None, out: str
) -> None:
    """Resume FSDP2 training (other initial weights; ``locals_`` None: a single-tier
    Checkpointer); record the iteration and tier each rank resumed, and (rank 0) the full state."""
    training = _fsdp_training(1)
    tiers: list[str | None] = []
    local = None if locals_ is None else locals_[rank]
    local_tier = None if local is None else LocalTier(local)
    with Checkpointer(
        url,
        options,
        local_tier=local_tier,
        on_event=lambda e: tiers.append(e.tier) if e.kind == "load_end" else None,
    ) as ckpt:
        iteration = ckpt.load(**training.keys())
    training.after_load()
    state = training.full_state()
    Path(f"{out}.{rank}").write_text(json.dumps([iteration, tiers]))
    if rank == 0:
        torch.save(state, f"{out}.state")


def _resumed(out: str, saved: str, iteration: int, tier: str | None) -> None:
    """Both ranks resumed ``iteration`` from ``tier``; model, optimizer, scheduler and data
    position are bitwise those saved."""
    for rank in (0, 1):
        assert json.loads(Path(f"{out}.{rank}").read_text()) == [iteration, [tier]], f"rank {rank}"
    resumed, reference = (
        torch.load(f"{out}.state", weights_only=False),
        torch.load(f"{saved}.{iteration}", weights_only=False),
    )
    assert_same_full_state(resumed, reference)


@pytest.mark.slow
def test_two_fsdp2_ranks_resume_bit_exact_from_the_local_tier_or_from_the_durable_one_when_a_rank_lost_it(
    s3_backend: Backend, tmp_path: Path
) -> None:
    url, options = s3_backend.url, s3_backend.storage_options
    local, saved = str(tmp_path / "node-local"), str(tmp_path / "saved")
    run_ranks(_fsdp_save, 2, tmp_path, url, options, local, saved)
    assert _pointer(url, options) == 4 and _pointer(local, {}) == 6
    fs = fsspec.filesystem("s3", **options)
    shards = {name.rsplit("/", 1)[1] for name in fs.find(f"{url}/iter_000000004/model")}
    assert shards == {"__0_0.distcp", "__1_0.distcp", ".metadata"}  # each rank's shard; no marker left

    # Both ranks still have the local folder: 6, newer than the durable pointer, comes from it ...
    from_local = str(tmp_path / "from-local")
    run_ranks(_fsdp_resume, 2, tmp_path, url, options, [local, local], from_local)
    _resumed(from_local, saved, 6, LOCAL)
    assert _pointer(url, options) == 6  # ... and was drained again on the way

    # Rank 1 is on a fresh node (its local folder is empty): both resume 6 from the durable tier.
    from_durable = str(tmp_path / "from-durable")
    run_ranks(_fsdp_resume, 2, tmp_path, url, options, [local, str(tmp_path / "wiped")], from_durable)
    _resumed(from_durable, saved, 6, DURABLE)


def test_a_paused_drainer_starts_no_waiting_iteration_so_the_ranks_can_agree_which_to_drop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "local"
    with Checkpointer(tmp_path / "other-durable", local_tier=LocalTier(local, keep_last_n=3)) as ckpt:
        for it in (1, 2, 3):
            ckpt.save(it, trainer={"w": torch.ones(4) * it})
    local_root, durable = resolve(str(local), {}), resolve(str(tmp_path / "durable"), {})

    def job(iteration: int) -> drain.DrainJob:
        return drain.DrainJob(iteration, read_commit_record(local_root, iteration).save_id)  # type: ignore[union-attr,arg-type]

    first, second = _HoldDrain(1), _HoldDrain(2)
    second.release.set()  # only noticed, never held
    drain_log = logging.getLogger("dcp_fsspec.checkpoint.tiers.drain")
    drain_log.addHandler(first)
    drain_log.addHandler(second)
    ended = threading.Event()
    drainer = Drainer(
        local_root,
        durable,
        policy=DRAIN_LATEST,
        keep_last_n=None,
        on_end=lambda event: ended.set() if event.iteration == 1 else None,
    )
    try:
        caplog.set_level(logging.INFO, logger="dcp_fsspec")  # the holds read the drain's INFO lines
        drainer.submit(job(1))
        assert first.reached.wait(60)
        drainer.submit(job(2))
        with drainer.paused() as waiting:
            assert waiting == [2]
            first.release.set()
            assert ended.wait(60)  # the drain of 1 is over; 2 must not start while paused
            assert not second.reached.wait(1.0)
            drainer.submit(job(3), drop=set(waiting))
        drainer.wait(60)
    finally:
        first.release.set()
        drain_log.removeHandler(first)
        drain_log.removeHandler(second)
    assert run_listing.committed_iterations(durable) == [1, 3] and not second.reached.is_set()


@pytest.mark.slow
def test_two_fsdp2_ranks_each_with_its_own_local_disk_resume_locally_or_durably_and_the_durable_copy_is_plain(
    s3_backend: Backend, tmp_path: Path
) -> None:
    url, options = s3_backend.url, s3_backend.storage_options
    nodes, saved = [str(tmp_path / "node-0"), str(tmp_path / "node-1")], str(tmp_path / "saved")
    run_ranks(_fsdp_save, 2, tmp_path, url, options, str(tmp_path / "node-{rank}"), saved)
    assert _pointer(url, options) == 4 and [
        _pointer(f"{node}/rank{r}", {}) for r, node in enumerate(nodes)
    ] == [6, 6]

    # 6 is only on the nodes' disks: both ranks read their own copy (model and optimizer shards,
    # replicated entries included), and drain it again on the way.
    from_local = str(tmp_path / "from-local")
    run_ranks(_fsdp_resume, 2, tmp_path, url, options, nodes, from_local)
    _resumed(from_local, saved, 6, LOCAL)
    assert _pointer(url, options) == 6

    # The drained copy is a plain checkpoint: a single-tier Checkpointer, and torch's dcp.load.
    plain = str(tmp_path / "plain")
    run_ranks(_fsdp_resume, 2, tmp_path, url, options, None, plain)
    _resumed(plain, saved, 6, None)
    fs = fsspec.filesystem("s3", **options)
    model_files = {name.rsplit("/", 1)[1] for name in fs.find(f"{url}/iter_000000006/model")}
    assert model_files == {".metadata", "__0_0.distcp", "__1_0.distcp"}, model_files  # no parts, no markers
    reference = torch.load(f"{saved}.6", weights_only=False)["model"]
    whole = {name: torch.zeros_like(t) for name, t in reference.items()}
    dcp.load(
        whole, storage_reader=FsspecStorageReader(f"{url}/iter_000000006/model", storage_options=options)
    )
    assert all(torch.equal(whole[name], reference[name]) for name in reference)

    # Node 1 lost its disk: both ranks resume 6 from the durable tier.
    shutil.rmtree(nodes[1])
    from_durable = str(tmp_path / "from-durable")
    run_ranks(_fsdp_resume, 2, tmp_path, url, options, nodes, from_durable)
    _resumed(from_durable, saved, 6, DURABLE)


def _own_folders_async_save(rank: int, world_size: int, url: str, base: str, out: str) -> None:
    """Per-node local folders with async saves: stage, return, commit locally and drain behind."""
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, [Shard(0)])
    with Checkpointer(
        url, local_tier=LocalTier(f"{base}/node-{rank}"), async_mode="async_with_pinned_mem"
    ) as ckpt:
        for step in (1, 2):
            ckpt.save(step, trainer={"w": sharded * step, "r": torch.full((3,), 5.0), "step": step})
        ckpt.wait()
        Path(f"{out}.{rank}").write_text(json.dumps(ckpt.committed_iterations()))


@pytest.mark.slow
def test_async_saves_on_per_node_folders_commit_on_each_node_and_drain_into_one_plain_durable_checkpoint(
    tmp_path: Path,
) -> None:
    url, out = str(tmp_path / "durable"), str(tmp_path / "out")
    run_ranks(_own_folders_async_save, 2, tmp_path, url, str(tmp_path), out)
    for rank in (0, 1):
        assert json.loads(Path(f"{out}.{rank}").read_text()) == [1, 2]
        assert _pointer(str(tmp_path / f"node-{rank}" / f"rank{rank}"), {}) == 2
    assert _pointer(url, {}) == 2 and run_listing.committed_iterations(resolve(url)) == [1, 2]
    folder = tmp_path / "durable" / "iter_000000002" / "trainer"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    target = {"w": torch.zeros(8, 8), "r": torch.zeros(3), "step": 0}
    dcp.load(target, storage_reader=FsspecStorageReader(str(folder)), no_dist=True)
    assert torch.equal(target["w"], torch.arange(64.0).reshape(8, 8) * 2) and target["step"] == 2


_FROZEN_ROWS = 1024  # 1024 x 1024 float32: 4 MiB, 2 MiB on each rank


def _own_folders_incremental_save(
    rank: int, world_size: int, url: str, options: dict[str, Any], base: str, iteration: int
) -> None:
    """Per-node local folders, incremental: a frozen sharded tensor and a small one that changes."""
    mesh = init_device_mesh("cpu", (world_size,))
    frozen = distribute_tensor(
        torch.arange(_FROZEN_ROWS * 1024.0).reshape(_FROZEN_ROWS, 1024), mesh, [Shard(0)]
    )
    tier = LocalTier(f"{base}/node-{rank}", keep_last_n=2)
    with Checkpointer(url, options, incremental=True, local_tier=tier) as ckpt:
        ckpt.save(iteration, trainer={"frozen": frozen, "head": torch.full((4,), float(iteration))})


@pytest.mark.slow
def test_per_node_incremental_drains_upload_only_what_changed_on_every_rank(
    s3_server: LocalS3Server, s3_backend: Backend, tmp_path: Path
) -> None:
    """Each rank's content hashes go up under a name of their own, so the next drain finds the
    frozen records of every rank, not only of the rank that uploaded last, in save_dirname."""
    proxy = CountingProxy(s3_server.endpoint_url).start()
    try:
        options = dict(s3_backend.storage_options)
        options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
        run_ranks(_own_folders_incremental_save, 2, tmp_path, s3_backend.url, options, str(tmp_path), 1)
        first = proxy.received
        proxy.reset()
        run_ranks(_own_folders_incremental_save, 2, tmp_path, s3_backend.url, options, str(tmp_path), 2)
        second = proxy.received
    finally:
        proxy.stop()
    frozen_bytes = _FROZEN_ROWS * 1024 * 4
    assert first > frozen_bytes and second < frozen_bytes // 16, (first, second)
    assert _pointer(s3_backend.url, s3_backend.storage_options) == 2
    target = {"frozen": torch.zeros(_FROZEN_ROWS, 1024), "head": torch.zeros(4)}
    assert Checkpointer(s3_backend.url, s3_backend.storage_options).load(trainer=target) == 2
    assert torch.equal(target["frozen"], torch.arange(_FROZEN_ROWS * 1024.0).reshape(_FROZEN_ROWS, 1024))
    assert torch.equal(target["head"], torch.full((4,), 2.0))
    # Retired by retention, iteration 1 keeps every rank's hashes for the next drain to compare.
    durable = resolve(s3_backend.url, s3_backend.storage_options)
    retention.apply_retention(durable, 1, latest=2)
    durable.fs.invalidate_cache()
    kept = {
        p.rsplit("/", 1)[-1] for p in durable.fs.ls(durable.join("iter_000000001", "trainer"), detail=False)
    }
    assert {".metadata", ".content_hashes.json", "__1.content_hashes.json"} <= kept, kept
