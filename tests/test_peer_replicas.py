"""Replicas of the per-node local tier on other nodes: sent at save, used at load (issue 49).

"Nodes" are groups of ranks, each group with a local folder of its own (``node-{n}``): the
per-node mode tells them apart. Real gloo groups, one machine; the durable tier is a local
folder, or moto behind a counting proxy where the bytes it serves are counted.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_fsspec import Checkpointer, LocalTier
from dcp_fsspec.checkpoint.commit import run_listing
from dcp_fsspec.checkpoint.tiers.nodes import Ring, nodes_from_names, nodes_from_sightings
from dcp_fsspec.checkpoint.tiers.replica_files import MANIFEST_NAME, parse_manifest
from dcp_fsspec.checkpoint.tiers.share_sources import (
    DURABLE,
    OWN,
    PEER,
    DurableFacts,
    NeedDurable,
    Source,
    plan_shares,
)
from dcp_fsspec.errors import CorruptCheckpointError
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.transport.urls import resolve
from dcp_fsspec.tools.ls import list_run
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.servers.counting import CountingProxy

pytestmark = pytest.mark.timeout(600)

_ROWS = 16


def _expected(step: int) -> torch.Tensor:
    return torch.arange(_ROWS * 16.0).reshape(_ROWS, 16) * step


# -- what every rank computes alike ---------------------------------------------------------------


def test_each_copy_of_a_share_sits_on_the_next_nodes_rank_of_the_same_place() -> None:
    ring = Ring(((0, 1), (2, 3), (4, 5)), replicas=3)
    assert [ring.holder(1, c) for c in (1, 2)] == [3, 5]
    assert [ring.sender(1, c) for c in (1, 2)] == [5, 3]
    assert nodes_from_names(["a", "a", "b", "b"]) == ((0, 1), (2, 3))
    assert nodes_from_sightings([frozenset({0, 1}), frozenset({0, 1}), frozenset({2})]) == ((0, 1), (2,))


def test_replicas_refuse_nodes_of_unequal_size_and_fewer_nodes_than_copies() -> None:
    with pytest.raises(ValueError, match=r"as many ranks on every node.*LocalTier\(node=\.\.\.\)"):
        Ring(((0, 1), (2,)), replicas=2)
    with pytest.raises(ValueError, match="needs at least 3 nodes"):
        Ring(((0,), (1,)), replicas=3)
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        LocalTier("x", replicas=0)


def test_replicas_on_a_local_tier_every_rank_shares_are_refused_naming_it(tmp_path: Path) -> None:
    local = tmp_path / "nvme"
    with pytest.raises(ValueError, match=f"every rank sees {local} as one folder.*use replicas=1 there"):
        Checkpointer(str(tmp_path / "durable"), local_tier=LocalTier(str(local), replicas=2))


def test_a_lost_ranks_share_comes_from_a_peer_and_what_no_peer_holds_from_the_durable_tier() -> None:
    own = [{3: "t", 2: "s"}, {3: "t"}, {}, {}]
    held = [{(2, 3): "t"}, {(3, 3): "t"}, {}, {}]
    shares = plan_shares(own, held, None)
    assert shares is not None and shares.iteration == 3
    assert shares.sources == (Source(OWN), Source(OWN), Source(PEER, 0), Source(PEER, 1))
    # Rank 3's replica lost too: the durable tier must say whether it holds this save of 3.
    with pytest.raises(NeedDurable):
        plan_shares(own, [{(2, 3): "t"}, {}, {}, {}], None)
    mixed = plan_shares(own, [{(2, 3): "t"}, {}, {}, {}], DurableFacts(3, {3: "t"}))
    assert mixed is not None and mixed.sources[3] == Source(DURABLE) and mixed.ranks(DURABLE) == [3]
    # Another save of 3 on the durable tier does not complete this one: read it as without replicas.
    assert plan_shares(own, [{(2, 3): "t"}, {}, {}, {}], DurableFacts(3, {3: "other"})) is None
    # A durable tier newer than every local copy wins.
    assert plan_shares(own, held, DurableFacts(4, {})) is None


def test_a_manifest_naming_a_file_outside_its_folder_is_refused_naming_its_url() -> None:
    raw = json.dumps(
        {"format": 1, "src": 1, "iteration": 3, "token": "t", "world_size": 2, "files": [["../x", 1, 0]]}
    ).encode()
    with pytest.raises(CorruptCheckpointError, match="file:///n/.replica.json is not a replica manifest"):
        parse_manifest(raw, "file:///n/.replica.json")


# -- several ranks ----------------------------------------------------------------------------------


def _tier(base: str, rank: int, per_node: int, replicas: int) -> LocalTier:
    return LocalTier(f"{base}/node-{rank // per_node}", keep_last_n=1, replicas=replicas)


def _log_to(path: str) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("dcp_fsspec").addHandler(handler)
    logging.getLogger("dcp_fsspec").setLevel(logging.INFO)


def _save(
    rank: int,
    world_size: int,
    url: str,
    options: dict[str, Any],
    base: str,
    per_node: int,
    replicas: int,
    steps: tuple[int, ...] = (1, 2, 3),
) -> None:
    """Save ``steps`` (iterations 1 to 3) of a sharded and a replicated tensor, keeping one locally."""
    _log_to(f"{base}/save.{rank}.log")
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(_expected(1), mesh, [Shard(0)])
    with Checkpointer(url, options, local_tier=_tier(base, rank, per_node, replicas)) as ckpt:
        for step in steps:
            ckpt.save(step, trainer={"w": sharded * step, "r": torch.full((3,), 5.0), "step": step})


def _load(
    rank: int, world_size: int, url: str, options: dict[str, Any], base: str, per_node: int, replicas: int
) -> None:
    """Restart: load ``w`` sharded as saved; keep what came back, from which tier, and the log."""
    _log_to(f"{base}/load.{rank}.log")
    mesh = init_device_mesh("cpu", (world_size,))
    target = {
        "w": distribute_tensor(torch.zeros(_ROWS, 16), mesh, [Shard(0)]),
        "r": torch.zeros(3),
        "step": 0,
    }
    tiers: list[str | None] = []
    with Checkpointer(
        url,
        options,
        local_tier=_tier(base, rank, per_node, replicas),
        on_event=lambda e: tiers.append(e.tier) if e.kind == "load_end" else None,
    ) as ckpt:
        iteration = ckpt.load(trainer=target)
    whole = target["w"].full_tensor()  # a collective
    torch.save(
        {"iteration": iteration, "tiers": tiers, "w": whole, "r": target["r"], "step": target["step"]},
        f"{base}/loaded.{rank}",
    )


def _results(base: Path, world_size: int) -> list[dict[str, Any]]:
    results = [torch.load(base / f"loaded.{rank}") for rank in range(world_size)]
    for result in results:
        assert result["iteration"] == 3 and result["step"] == 3, result
        assert torch.equal(result["w"], _expected(3)) and torch.equal(result["r"], torch.full((3,), 5.0))
    return results


def _logs(base: Path, kind: str) -> str:
    return "\n".join(p.read_text() for p in sorted(base.glob(f"{kind}.*.log")))


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks as 2 nodes x 2, two copies of each share, drained to a local durable folder."""
    base = tmp_path_factory.mktemp("saved_2x2")
    run_ranks(_save, 4, base, str(base / "durable"), {}, str(base), 2, 2)
    return base


def _copy(saved: Path, tmp_path: Path) -> Path:
    base = tmp_path / "job"
    shutil.copytree(saved, base, ignore=shutil.ignore_patterns("pg-store-*", "*.log", "loaded.*"))
    return base


@pytest.mark.slow
def test_each_save_sends_every_ranks_committed_local_copy_to_the_same_place_on_the_other_node(
    saved_2x2: Path,
) -> None:
    for rank in range(4):
        node, holder = rank // 2, (rank + 2) % 4
        own = saved_2x2 / f"node-{node}" / f"rank{rank}" / "iter_000000003"
        replicas = saved_2x2 / f"node-{1 - node}" / f"rank{holder}" / "replicas" / f"rank{rank}"
        # The local tier's keep_last_n applies to replicas too: only iteration 3 is held.
        assert sorted(p.name for p in replicas.iterdir()) == ["iter_000000003"]
        copy = replicas / "iter_000000003"
        manifest = parse_manifest((copy / MANIFEST_NAME).read_bytes(), str(copy))
        assert manifest.src == rank and manifest.world_size == 4 and manifest.files[-1][0] == ".commit.json"
        for name, size in manifest.files:  # bit-exact copies of the committed local files
            assert (copy / name).read_bytes() == (own / name).read_bytes() and size == (
                own / name
            ).stat().st_size
    assert "2 copies of each rank's share, on nodes [[0, 1], [2, 3]]" in _logs(saved_2x2, "save")


@pytest.mark.slow
def test_a_lost_node_restores_from_its_peers_bit_exact_with_no_byte_from_the_durable_tier(
    s3_server: LocalS3Server, s3_backend: Backend, tmp_path: Path
) -> None:
    base = tmp_path
    run_ranks(_save, 4, tmp_path, s3_backend.url, s3_backend.storage_options, str(base), 2, 2, (3,))
    shutil.rmtree(base / "node-1")  # node 1 is lost; torchrun restarts every rank, node 1 on a new machine
    proxy = CountingProxy(s3_server.endpoint_url).start()
    try:
        options = dict(s3_backend.storage_options)
        options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
        run_ranks(_load, 4, tmp_path, s3_backend.url, options, str(base), 2, 2)
    finally:
        proxy.stop()
    results = _results(base, 4)
    assert [r["tiers"] for r in results] == [[OWN], [OWN], [PEER], [PEER]]
    assert proxy.sent == 0 and proxy.gets == 0, (proxy.sent, proxy.gets)
    # The replacement node has its local tier back: its own committed copy of iteration 3.
    for rank in (2, 3):
        assert run_listing.committed_iterations(resolve(str(base / "node-1" / f"rank{rank}"))) == [3]
    assert "rank(s) 2 from rank 0, 3 from rank 1 from peers' replicas" in _logs(base, "load")


@pytest.mark.slow
def test_a_damaged_replica_is_refused_with_a_warning_and_the_durable_tier_serves_that_share(
    saved_2x2: Path, tmp_path: Path
) -> None:
    base = _copy(saved_2x2, tmp_path)
    shutil.rmtree(base / "node-1")
    copy = base / "node-0" / "rank0" / "replicas" / "rank2" / "iter_000000003" / "trainer"
    shard = next(copy.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    run_ranks(_load, 4, tmp_path, str(base / "durable"), {}, str(base), 2, 2)
    results = _results(base, 4)
    assert [r["tiers"] for r in results] == [[OWN], [OWN], [DURABLE], [PEER]]
    warning = next(line for line in _logs(base, "load").splitlines() if "is damaged" in line)
    assert warning.startswith("WARNING") and str(shard) in warning and "the next source is used" in warning


@pytest.mark.slow
def test_a_replica_half_written_when_its_sender_died_is_never_used(saved_2x2: Path, tmp_path: Path) -> None:
    base = _copy(saved_2x2, tmp_path)
    shutil.rmtree(base / "node-1")
    # What a sender that died mid-transfer leaves: some files, one cut short, no manifest.
    copy = base / "node-0" / "rank1" / "replicas" / "rank3" / "iter_000000003"
    (copy / MANIFEST_NAME).unlink()
    shard = next((copy / "trainer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    run_ranks(_load, 4, tmp_path, str(base / "durable"), {}, str(base), 2, 2)
    results = _results(base, 4)
    assert [r["tiers"] for r in results] == [[OWN], [OWN], [PEER], [DURABLE]]
    assert "3 from the durable tier" in _logs(base, "load") or "rank(s) [3] from the durable" in _logs(
        base, "load"
    )


@pytest.mark.slow
def test_another_world_size_on_load_reads_the_durable_tier_saying_why(
    saved_2x2: Path, tmp_path: Path
) -> None:
    base = _copy(saved_2x2, tmp_path)
    shutil.rmtree(base / "node-1")
    run_ranks(_load, 2, tmp_path, str(base / "durable"), {}, str(base), 1, 2)
    results = _results(base, 2)
    assert [r["tiers"] for r in results] == [[DURABLE], [DURABLE]]
    assert "saved by [4] ranks and this job has 2" in _logs(base, "load")


@pytest.mark.slow
def test_a_lost_clique_reads_only_its_ranks_shares_from_the_durable_tier(tmp_path: Path) -> None:
    # 3 nodes of one rank, two copies: node n's share is also on node n + 1. Nodes 0 and 1 lost:
    # rank 1's share is on node 2; rank 0's copies were on nodes 0 and 1, so it alone reads durable.
    url = str(tmp_path / "durable")
    run_ranks(_save, 3, tmp_path, url, {}, str(tmp_path), 1, 2)
    shutil.rmtree(tmp_path / "node-0")
    shutil.rmtree(tmp_path / "node-1")
    run_ranks(_load, 3, tmp_path, url, {}, str(tmp_path), 1, 2)
    results = _results(tmp_path, 3)
    assert [r["tiers"] for r in results] == [[DURABLE], [PEER], [OWN]]
    assert "rank(s) [0] from the durable tier" in _logs(tmp_path, "load")


@pytest.mark.slow
def test_ls_on_a_ranks_local_folder_shows_the_replicas_it_holds_committed_or_not(
    saved_2x2: Path, tmp_path: Path
) -> None:
    base = _copy(saved_2x2, tmp_path)
    (base / "node-0" / "rank1" / "replicas" / "rank3" / "iter_000000003" / MANIFEST_NAME).unlink()
    listing = list_run(str(base / "node-0" / "rank1"))
    assert [(r.src, r.iteration, r.committed) for r in listing.replicas] == [(3, 3, False)]
    text = "\n".join(list_run(str(base / "node-0" / "rank0")).lines())
    assert "replicas held here" in text and "iter_000000003  yes" in text, text


def _send_with_crcs(rank: int, world_size: int, base: str, wrong: bool) -> None:
    """Rank 0 sends a folder of two files (one empty) to rank 1, with their CRC-32s or wrong ones."""
    import torch.distributed as dist

    from dcp_fsspec.checkpoint.tiers.peer_transfer import Folder, exchange
    from dcp_fsspec.storage.format.crc import crc32

    group = dist.new_group(backend="gloo")
    if rank == 0:
        source = resolve(f"{base}/from")
        payload = bytes(range(256)) * 40_000
        Path(f"{base}/from/k").mkdir(parents=True)
        Path(f"{base}/from/k/data").write_bytes(payload)
        Path(f"{base}/from/empty").write_bytes(b"")
        crcs = (crc32(payload, 0) ^ int(wrong), 0)
        exchange(group, (1, Folder(source, (("k/data", len(payload)), ("empty", 0)), {"src": 0}, crcs)), None)
        return
    try:
        arrived = exchange(group, None, (0, resolve(f"{base}/to")))
    except CorruptCheckpointError as e:
        Path(f"{base}/error").write_text(str(e))
        return
    assert arrived is not None and arrived.about == {"src": 0}
    assert Path(f"{base}/to/k/data").read_bytes() == Path(f"{base}/from/k/data").read_bytes()
    assert Path(f"{base}/to/empty").read_bytes() == b""


@pytest.mark.slow
def test_a_file_arriving_with_another_crc_than_the_senders_is_refused_naming_it(tmp_path: Path) -> None:
    run_ranks(_send_with_crcs, 2, tmp_path, str(tmp_path / "good"), False)
    assert not (tmp_path / "good" / "error").exists()
    run_ranks(_send_with_crcs, 2, tmp_path, str(tmp_path / "bad"), True)
    error = (tmp_path / "bad" / "error").read_text()
    assert str(tmp_path / "bad" / "to" / "k" / "data") in error and "not the sender's" in error, error
