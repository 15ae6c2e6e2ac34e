"""At load, each rank's share gathered from its own copy, a peer's replica, or the durable tier.

A collective, in three steps: 1. every rank reports its own committed local iterations and the
replicas it holds, and every rank computes the same sources
(:func:`~dcp_fsspec.checkpoint.tiers.share_sources.plan_shares`); 2. each holder checks the
replicas it is to send against their manifests (a damaged one is refused with a WARNING and
the sources computed again without it); 3. each holder sends them over the replicas' group to
the rank whose share they are, which writes them into its own local tier, CRC-checked, commit
record last: a replacement node gets its local tier back. A rank with no copy anywhere reads
its share from the durable tier.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch.distributed as dist

from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.checkpoint.commit import layout, pointer
from dcp_fsspec.checkpoint.commit.commit_record import read_commit_record
from dcp_fsspec.checkpoint.tiers.peer_transfer import Folder, exchange
from dcp_fsspec.checkpoint.tiers.replica_files import Replica, held_replicas
from dcp_fsspec.checkpoint.tiers.replicas import verified
from dcp_fsspec.checkpoint.tiers.share_sources import (
    DURABLE,
    OWN,
    PEER,
    DurableFacts,
    NeedDurable,
    Shares,
    plan_shares,
)
from dcp_fsspec.errors import DcpFsspecError
from dcp_fsspec.storage.transport.urls import Location

logger = logging.getLogger(__name__)


class PeerRestore:
    """The load side of the replicas (see the module docstring); every rank calls :meth:`shares`.

    Args:
        local: this rank's local tier (its ``rank{r}`` folder).
        durable: ``save_dirname``.
        collectives: the ranks of the checkpoint.
        group: the replicas' own process group.
    """

    def __init__(
        self, local: Location, durable: Location, collectives: Collectives, group: dist.ProcessGroup
    ) -> None:
        self._local = local
        self._durable = durable
        self._collectives = collectives
        self._group = group
        self.durable_latest: int | None = None

    def shares(self, own: Mapping[int, str | None], iteration: int | None) -> Shares | None:
        """Agree on each rank's source and bring the peers' replicas home; None: read the durable
        tier as without replicas (logged: another world size, nothing local, or a failed transfer)."""
        self.durable_latest = None
        mine = held_replicas(self._local)
        gathered = self._collectives.all_gather(
            (dict(own), {k: (r.token, r.world_size) for k, r in mine.items()})
        )
        sizes = {size for _, held in gathered for _, size in held.values()}
        if sizes - {self._collectives.world_size}:
            self._log(
                logging.WARNING,
                "the replicas in the local tier were saved by %s ranks and this job has %d: a rank's share "
                "then is another one, so every rank reads the durable tier %s",
                sorted(sizes),
                self._collectives.world_size,
                self._durable.url,
            )
            return None
        owns = [g[0] for g in gathered]
        held = [{k: token for k, (token, _) in g[1].items()} for g in gathered]
        chosen = self._agree(owns, held, mine, iteration)
        if chosen is None:
            return None
        shares, folders = chosen
        self._say(shares)
        return shares if self._bring_home(shares, folders) else None

    def _agree(
        self,
        owns: list[dict[int, str | None]],
        held: list[dict[tuple[int, int], str]],
        mine: dict[tuple[int, int], Replica],
        iteration: int | None,
    ) -> tuple[Shares, dict[int, Folder]] | None:
        """The sources, once every replica to send is checked (a damaged one leaves the plan)."""
        durable: DurableFacts | None = None
        while True:
            try:
                shares = plan_shares(owns, held, durable, iteration=iteration)
            except NeedDurable as e:
                asked = e.iterations
                durable = self._collectives.run_on_rank0(lambda: self._durable_facts(asked))
                self.durable_latest = durable.latest
                continue
            if shares is None:
                return None
            folders: dict[int, Folder] = {}
            refused: list[tuple[int, int]] = []
            for rank, source in enumerate(shares.sources):
                if source.kind == PEER and source.holder == self._collectives.rank:
                    folder = verified(self._local, mine[(rank, shares.iteration)])
                    if folder is None:
                        refused.append((rank, shares.iteration))
                    else:
                        folders[rank] = folder
            everyone = self._collectives.all_gather(refused)
            if not any(everyone):
                return shares, folders
            for holder, bad in enumerate(everyone):
                for key in bad:
                    held[holder].pop(key, None)

    def _durable_facts(self, iterations: list[int]) -> DurableFacts:
        """On rank 0: the durable pointer, and the tokens of the newest ``iterations`` it holds."""
        try:
            latest = pointer.read_pointer(self._durable)
            tokens: dict[int, str | None] = {}
            for it in iterations:
                if latest is not None and it <= latest:
                    record = read_commit_record(self._durable, it)
                    tokens[it] = None if record is None else record.save_id
            return DurableFacts(latest, tokens)
        except (OSError, DcpFsspecError) as e:
            logger.warning(
                "cannot read the durable tier %s (%s): only the local tiers are used", self._durable.url, e
            )
            return DurableFacts(None, {})

    def _bring_home(self, shares: Shares, folders: dict[int, Folder]) -> bool:
        """Every replica to send, sent, in one order on every rank (so no two ranks wait on each
        other); each arrives into its rank's own local tier. False (logged) if any failed."""
        me = self._collectives.rank
        error: Exception | None = None
        for rank, source in enumerate(shares.sources):
            if source.kind != PEER:
                continue
            try:
                if me == source.holder:
                    exchange(self._group, (rank, folders[rank]), None)
                elif me == rank and source.holder is not None:
                    target = self._local.at(layout.iteration_path(self._local, shares.iteration))
                    self._local.backend.remove_trees([target.path], within=self._local.path)
                    exchange(self._group, None, (source.holder, target))
            except (OSError, DcpFsspecError) as e:
                error = e
        failed = [(r, str(e)) for r, e in enumerate(self._collectives.all_gather(error)) if e is not None]
        if failed:
            self._log(
                logging.WARNING,
                "bringing the replicas of %s home failed (%s): every rank reads the durable tier %s",
                layout.format_iteration(shares.iteration),
                "; ".join(f"rank {r}: {e}" for r, e in failed),
                self._durable.url,
            )
            return False
        return True

    def _say(self, shares: Shares) -> None:
        peers = ", ".join(f"{r} from rank {shares.sources[r].holder}" for r in shares.ranks(PEER))
        self._log(
            logging.INFO if not shares.ranks(DURABLE) else logging.WARNING,
            "resuming %s: rank(s) %s from their own local copies; %s from peers' replicas; %s from the "
            "durable tier %s",
            layout.format_iteration(shares.iteration),
            shares.ranks(OWN),
            f"rank(s) {peers}" if peers else "none",
            f"rank(s) {shares.ranks(DURABLE)}" if shares.ranks(DURABLE) else "none",
            self._durable.url,
        )

    def _log(self, level: int, message: str, *args: object) -> None:
        if self._collectives.rank == 0:
            logger.log(level, message, *args)
