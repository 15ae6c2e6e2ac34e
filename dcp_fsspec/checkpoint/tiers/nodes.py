"""Which ranks share a node (a local disk), and which ranks on other nodes hold a rank's replicas.

A node is the ranks that see each other's probe file in the local tier's ``dirname``, or the
ranks the user gave the same ``LocalTier(node=…)``. Replicas go round a ring of nodes: rank
``r``'s copy ``k`` sits on the rank with ``r``'s place in its node on the ``k``-th next node, so
each copy of a share is on another node, and a lost node's shares are on the nodes after it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.errors import DcpFsspecError
from dcp_fsspec.storage.transport.urls import Location

_PROBE_PREFIX = ".dcp-fsspec-node-"


@dataclass(frozen=True)
class Ring:
    """The nodes, each a tuple of ranks ascending, ordered by their lowest rank.

    Attributes:
        nodes: the ranks of each node.
        replicas: how many copies of each share there are, its own included (>= 1).
    """

    nodes: tuple[tuple[int, ...], ...]
    replicas: int

    def __post_init__(self) -> None:
        sizes = {len(node) for node in self.nodes}
        if self.replicas > 1 and len(sizes) > 1:
            raise ValueError(
                f"LocalTier(replicas={self.replicas}) needs as many ranks on every node; the nodes found "
                f"are {[list(n) for n in self.nodes]}: give each rank its node with LocalTier(node=...)"
            )
        if self.replicas > len(self.nodes):
            raise ValueError(
                f"LocalTier(replicas={self.replicas}) needs at least {self.replicas} nodes, one per copy; "
                f"{len(self.nodes)} found ({[list(n) for n in self.nodes]}): lower replicas, or give "
                "each rank its node with LocalTier(node=...)"
            )

    def _place(self, rank: int) -> tuple[int, int]:
        for n, node in enumerate(self.nodes):
            if rank in node:
                return n, node.index(rank)
        raise ValueError(f"rank {rank} is on no node of {self.nodes}")

    def holder(self, rank: int, copy: int) -> int:
        """The rank that holds ``rank``'s replica number ``copy`` (1 .. replicas - 1)."""
        n, place = self._place(rank)
        return self.nodes[(n + copy) % len(self.nodes)][place]

    def sender(self, rank: int, copy: int) -> int:
        """The rank whose replica number ``copy`` ``rank`` holds."""
        n, place = self._place(rank)
        return self.nodes[(n - copy) % len(self.nodes)][place]

    def node_of(self, rank: int) -> int:
        """The index of ``rank``'s node."""
        return self._place(rank)[0]


def nodes_from_names(names: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The nodes, from each rank's node name (ranks with one name share a node)."""
    by_name: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        by_name.setdefault(name, []).append(rank)
    return tuple(sorted(tuple(ranks) for ranks in by_name.values()))


def nodes_from_sightings(seen: Sequence[frozenset[int]]) -> tuple[tuple[int, ...], ...]:
    """The nodes, from the ranks whose probe each rank saw (itself included)."""
    return tuple(sorted({tuple(sorted(ranks | {rank})) for rank, ranks in enumerate(seen)}))


def find_nodes(local: Location, collectives: Collectives, node: str | None) -> tuple[tuple[int, ...], ...]:
    """The nodes, the same on every rank (a collective).

    With ``node`` given by every rank, from those names; else by a probe: every rank writes a
    file of its own into its ``local``, then lists it to see whose files are there.
    """
    names = collectives.all_gather(node)
    if all(name is not None for name in names):
        return nodes_from_names([str(name) for name in names])
    tag = collectives.run_on_rank0(lambda: uuid.uuid4().hex[:12])
    mine = f"{_PROBE_PREFIX}{tag}-{collectives.rank}"
    wrote = _write_probe(local, mine)
    collectives.all_gather(wrote)  # every probe is written before any rank looks
    seen = _probes_seen(local, f"{_PROBE_PREFIX}{tag}-") if wrote else frozenset()
    sightings = collectives.all_gather(seen)
    if wrote:
        try:
            local.backend.call("rm", local.join(mine))
        except (OSError, DcpFsspecError):
            pass  # a leftover probe is harmless: its tag is this job's alone
    return nodes_from_sightings(sightings)


def _write_probe(local: Location, name: str) -> bool:
    try:
        local.backend.make_folder(local.path)
        local.backend.write_small_atomic(local.join(name), b"")
    except (OSError, DcpFsspecError):
        return False  # a folder this rank cannot write is a node of its own
    return True


def _probes_seen(local: Location, prefix: str) -> frozenset[int]:
    local.backend.invalidate(local.path)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in local.fs.ls(local.path, detail=False)]
    except (OSError, DcpFsspecError):
        return frozenset()
    return frozenset(
        int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()
    )
