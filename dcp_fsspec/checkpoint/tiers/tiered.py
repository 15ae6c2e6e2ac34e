"""Two tiers: a fast ``local_dirname`` every save commits to first, and the durable ``save_dirname``.

:class:`TwoTiers` is what the Checkpointer holds when it is given ``local_dirname``: after each
local commit it hands the iteration, with its save's token, to every rank's
:class:`~dcp_fsspec.checkpoint.tiers.drain_thread.Drainer` (each copies the files it wrote; under ``drain="latest"`` the ranks agree
first on which waiting iterations to drop), applies the local retention (``keep_last_n_local``;
never an iteration still to drain, never the newest), and warns if the last drain failed; at
``wait`` it waits for every rank's drain and raises any rank's error on every rank. These steps
run in the caller's thread, so their collectives never overlap training's. For ``load`` it
decides which tier to read, as a pure function of a few facts (:func:`choose_tier`): the newest
iteration committed in at least one tier that every rank can read, read from the local tier
where every rank has it committed and complete there.

Two layouts of the local tier, chosen at construction by a probe (a file rank 0 writes, every
rank looks for): *shared*, when every rank sees one ``local_dirname`` (one node, or a shared file
system): one checkpoint for all ranks, committed by rank 0, as a direct save; *per node*, when
some rank cannot see it (each node its own NVMe at the same path, as Orbax's emergency
checkpointing and NVIDIA's local checkpointing have it): each rank keeps its own checkpoint of
its own share under ``{local_dirname}/rank{r}/``, saved and loaded without collectives
(``dcp.save`` then writes every entry the rank holds, replicated ones included, so each copy is
self-sufficient for its rank's load), with its own commit record, pointer and retention. Ranks
of one node then share the disk, not files. The drain merges the ranks' copies into one plain
durable checkpoint (:mod:`~dcp_fsspec.checkpoint.tiers.drain`, :mod:`~dcp_fsspec.checkpoint.tiers.metadata_merge`). A local copy is loaded only if every rank's
covers everything that rank loads; else every rank reads the durable tier.

Per node with ``replicas`` >= 2, each rank's committed local iterations are also copied to ranks
on other nodes (:mod:`~dcp_fsspec.checkpoint.tiers.replicas`), and ``load`` takes each rank's
share from its own copy, a peer, or the durable tier
(:mod:`~dcp_fsspec.checkpoint.tiers.peer_restore`).
"""

from __future__ import annotations

import logging
import posixpath
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

import torch.distributed as dist

from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.checkpoint.commit import deletion, layout, loadable, pointer, retention, run_listing
from dcp_fsspec.checkpoint.commit.commit_record import read_commit_record
from dcp_fsspec.checkpoint.events import CheckpointEvent
from dcp_fsspec.checkpoint.options import DRAIN_LATEST
from dcp_fsspec.checkpoint.tiers.drain import DrainJob
from dcp_fsspec.checkpoint.tiers.drain_thread import Drainer
from dcp_fsspec.checkpoint.tiers.nodes import Ring, find_nodes
from dcp_fsspec.checkpoint.tiers.peer_restore import PeerRestore
from dcp_fsspec.checkpoint.tiers.replicas import ReplicaJob, Replicator
from dcp_fsspec.checkpoint.tiers.share_sources import Shares
from dcp_fsspec.errors import CorruptCheckpointError, DcpFsspecError, DrainError, StorageError
from dcp_fsspec.storage.format.names import POINTER_NAME
from dcp_fsspec.storage.transport.urls import Location, resolve

logger = logging.getLogger(__name__)

LOCAL = "local"
DURABLE = "durable"


class TierChoice(NamedTuple):
    """The iteration ``load`` resumes, and the tier it reads it from (``LOCAL`` or ``DURABLE``)."""

    iteration: int
    tier: str


def choose_tier(
    durable_latest: int | None, local_per_rank: Sequence[Collection[int]], *, iteration: int | None = None
) -> TierChoice | None:
    """Which iteration ``load`` resumes and from which tier; ``None``: no iteration in either.

    Args:
        durable_latest: the iteration the durable pointer names (``None``: none, or unreadable).
        local_per_rank: for each rank, the iterations committed and complete in its local tier.
        iteration: the iteration asked for (``load(iteration=N)``), if any.

    Returns:
        ``(iteration, LOCAL)`` when every rank has that iteration locally and it is not older
        than the durable pointer; else ``(durable_latest or iteration, DURABLE)``.
    """
    everywhere = set.intersection(*(set(r) for r in local_per_rank)) if local_per_rank else set()
    if iteration is not None:
        return TierChoice(iteration, LOCAL if iteration in everywhere else DURABLE)
    newest_local = max(everywhere, default=None)
    if newest_local is not None and (durable_latest is None or newest_local >= durable_latest):
        return TierChoice(newest_local, LOCAL)
    return None if durable_latest is None else TierChoice(durable_latest, DURABLE)


def one_save_everywhere(per_rank: Sequence[Mapping[int, str | None]]) -> list[set[int]]:
    """For each rank, its local iterations that every rank holds as the same save (same token).

    Per node, a node may keep a copy of an iteration that another run saved (a node out of the
    job while the others resumed an older iteration and saved it again): it counts for no rank.

    Args:
        per_rank: for each rank, its committed local iterations and their saves' tokens.
    """
    return [
        {i for i, token in mine.items() if all(i in other and other[i] == token for other in per_rank)}
        for mine in per_rank
    ]


def readable_locally(local: Location, *, trust_checkpoint: bool) -> dict[int, str | None]:
    """This rank's committed local iterations whose keys are all there (their ``.metadata``
    carries the save's token and names files present), with that token. A local tier that
    cannot be read counts as empty (logged): the durable one is there for that."""
    try:
        listed = run_listing.list_save_dirname(local)
        readable: dict[int, str | None] = {}
        for iteration in listed.folders:
            record = run_listing.listed_record(local, listed, iteration)
            if record is None:
                continue
            try:
                loadable.require_saved_together(local, record, trust_checkpoint=trust_checkpoint)
            except CorruptCheckpointError as e:
                logger.warning(
                    "not resuming from the local copy %s: %s", layout.format_iteration(iteration), e
                )
                continue
            readable[iteration] = record.save_id
        return readable
    except (OSError, DcpFsspecError) as e:
        logger.warning("cannot read the local tier %s (%s); resuming from the durable tier", local.url, e)
        return {}


def rank_tier(local: Location, rank: int) -> Location:
    """Rank ``rank``'s own local tier in per-node mode: ``{local_dirname}/rank{rank}``."""
    return resolve(
        posixpath.join(local.secret_url, layout.rank_folder_name(rank)), fs=local.fs, retry=local.retry
    )


class TwoTiers:
    """The local tier, the drain to the durable one, and the load decision between them.

    Constructing it is a collective (the probe that picks the layout, see the module
    docstring). Every rank calls every method; every rank drains its own files; rank 0 alone
    commits the durable copy and reads the durable pointer; the local tier is pruned by rank 0
    (shared) or by each rank (per node).

    Attributes:
        local: this rank's local tier: ``local_dirname``, or (per node) its ``rank{r}`` folder.
        per_node: whether each rank keeps its own local copy.
        save_collectives: the ranks a local save or load spans: all of them, or (per node) this
            rank alone.

    Args:
        local: the ``local_dirname`` location.
        durable: the ``save_dirname`` location.
        collectives: the ranks the checkpoint spans.
        keep_last_n_local: local retention (>= 1).
        keep_last_n: durable retention (``None``: keep all).
        drain: the drain policy (:data:`~dcp_fsspec.checkpoint.options.DRAIN_EVERY` or :data:`~dcp_fsspec.checkpoint.options.DRAIN_LATEST`).
        on_drain_end: called with each ``drain_end`` event.
        replicas: copies of each rank's local share, its own included (>= 2: per node only,
            see :mod:`~dcp_fsspec.checkpoint.tiers.replicas`).
        node: this rank's node name, if the user gave it (else a probe finds the nodes).

    Raises:
        ValueError: ``replicas`` >= 2 on a shared local tier, or on nodes that cannot hold them.
    """

    def __init__(
        self,
        local: Location,
        durable: Location,
        collectives: Collectives,
        *,
        keep_last_n_local: int,
        keep_last_n: int | None,
        drain: str,
        on_drain_end: Callable[[CheckpointEvent], None],
        replicas: int = 1,
        node: str | None = None,
    ) -> None:
        self.durable = durable
        self._collectives = collectives
        self._keep_last_n_local = keep_last_n_local
        self.per_node = not self._shared(local)
        self.local = rank_tier(local, collectives.rank) if self.per_node else local
        self.save_collectives = Collectives(alone=True) if self.per_node else collectives
        # Rank 0 alone prunes and rewinds a shared local tier; per node, each rank its own.
        self._owns_local = self.per_node or collectives.rank == 0
        # Rank 0 waits this long for the other ranks' copies once its own is done: their shares are
        # about the size of its own, so the retry deadline (a bound on one stuck call) is ample.
        marker_wait = (
            durable.retry.deadline if durable.retry is not None and durable.retry.deadline else 600.0
        )
        self._drainer = Drainer(
            self.local,
            durable,
            policy=drain,
            keep_last_n=keep_last_n,
            on_end=on_drain_end,
            rank=collectives.rank,
            world_size=collectives.world_size,
            marker_wait=marker_wait,
            per_node=self.per_node,
        )
        self.replicator: Replicator | None = None
        self._peers: PeerRestore | None = None
        if replicas > 1:
            self._replicate(local, replicas, node)

    def _replicate(self, local: Location, replicas: int, node: str | None) -> None:
        """Find the nodes, make the replicas' own group, start nothing yet (a collective)."""
        if not self.per_node:
            raise ValueError(
                f"LocalTier(replicas={replicas}) copies each node's local share to other nodes, but every rank "
                f"sees {local.url} as one folder (a shared local tier): use replicas=1 there, or give each "
                "node a local disk of its own"
            )
        ring = Ring(find_nodes(local, self._collectives, node), replicas)
        group = self._collectives.group
        ranks = None if group is None else dist.get_process_group_ranks(group)
        # Its own group: transfers in the background never meet training's collectives, nor ours.
        replica_group = dist.new_group(ranks=ranks, backend="gloo")
        self.replicator = Replicator(
            self.local,
            replica_group,
            ring,
            rank=self._collectives.rank,
            world_size=self._collectives.world_size,
            keep_last_n=self._keep_last_n_local,
        )
        self._peers = PeerRestore(self.local, self.durable, self._collectives, replica_group)
        if self._collectives.rank == 0:
            logger.info(
                "local tier %s: %d copies of each rank's share, on nodes %s (rank r's on the next nodes' "
                "rank of the same place)",
                local.url,
                replicas,
                [list(n) for n in ring.nodes],
            )

    @property
    def replicated(self) -> bool:
        """Whether each rank's local share has copies on other nodes."""
        return self._peers is not None

    def _shared(self, local: Location) -> bool:
        """Whether every rank sees ``local`` as one folder (a collective; logged once, on rank 0).

        Rank 0 writes a probe file into it and every rank looks for it in its own
        ``local_dirname`` (ranks may be given different paths). A single process shares trivially.
        """
        if not self._collectives.distributed:
            return True

        def write_probe() -> str:
            name = f".dcp-fsspec-probe-{uuid.uuid4().hex[:12]}"
            local.backend.make_folder(local.path)
            local.backend.write_small_atomic(local.join(name), b"")
            return name

        path = local.join(self._collectives.run_on_rank0(write_probe))
        local.backend.invalidate(local.path)
        try:
            mine = run_listing.exists(local, path)
        except (OSError, DcpFsspecError):
            mine = False  # a folder this rank cannot read is no folder it shares
        seen = self._collectives.all_gather(mine)  # every rank gets here: no rank raises alone
        blind = [rank for rank, saw in enumerate(seen) if not saw]
        if self._collectives.rank == 0:
            try:
                local.backend.call("rm", path)
            except (OSError, DcpFsspecError) as e:
                logger.info("could not remove the probe %s (harmless): %s", local.url_of(path), e)
            if blind:
                logger.info(
                    "local tier %s: per-node mode: rank(s) %s cannot see the file rank 0 wrote there (a disk "
                    "of their own), so each rank keeps its own local copy under rank<N>/ of its local_dirname",
                    local.url,
                    blind,
                )
            else:
                logger.info("local tier %s: shared by every rank: rank 0 commits each local save", local.url)
        return not blind

    def committed_locally(self, iteration: int) -> None:
        """``iteration`` is committed in the local tier: drain it, then prune the local tier.

        If the last drain failed, say so (a WARNING naming both tiers): this one tries again.
        """
        token = self._collectives.run_on_rank0(lambda: self._local_token(iteration))
        failure = self._submit(iteration, token)
        if self.replicator is not None:
            self.replicator.submit(ReplicaJob(iteration, token))
        if failure is not None:
            logger.warning(
                "the durable tier %s is behind the local tier %s: %s. Training goes on: %s is committed "
                "locally and is being drained",
                self.durable.url,
                self.local.url,
                failure,
                layout.format_iteration(iteration),
            )
        if self._owns_local:
            retention.apply_retention(
                self.local,
                self._keep_last_n_local,
                protected=self._drainer.undrained()
                | {iteration}
                | (set() if self.replicator is None else self.replicator.busy()),
            )

    def _submit(self, iteration: int, token: str | None = None) -> DrainError | None:
        """Hand the committed local ``iteration`` to every rank's drainer (a collective).

        Rank 0 reads the save's token from the local commit record; under ``drain="latest"``
        the ranks drop only the waiting iterations that every rank still has waiting, so no
        rank commits, or waits for, an iteration another rank dropped or started.
        """
        if token is None:
            token = self._collectives.run_on_rank0(lambda: self._local_token(iteration))
        job = DrainJob(iteration, token)
        if self._drainer.policy != DRAIN_LATEST:
            return self._drainer.submit(job)
        with self._drainer.paused() as waiting:
            everywhere = set.intersection(*(set(w) for w in self._collectives.all_gather(waiting)))
            return self._drainer.submit(job, drop=everywhere)

    def _local_token(self, iteration: int) -> str:
        """The token of the save committed locally as ``iteration`` (``""`` if unreadable: the
        drain then refuses it, naming why)."""
        try:
            record = read_commit_record(self.local, iteration)
        except (OSError, DcpFsspecError) as e:
            logger.warning(
                "cannot read the local commit record of %s under %s: %s",
                layout.format_iteration(iteration),
                self.local.url,
                e,
            )
            return ""
        return "" if record is None or record.save_id is None else record.save_id

    def resumed_locally(self, iteration: int, durable_latest: int | None) -> None:
        """``load`` read ``iteration`` from the local tier: drain it if the durable tier lacks it
        (a drain that a killed run left unfinished)."""
        if durable_latest is None or durable_latest < iteration:
            if self._collectives.rank == 0:
                logger.info(
                    "%s is newer than the durable tier %s: draining it again",
                    layout.format_iteration(iteration),
                    self.durable.url,
                )
            self._submit(iteration)

    def forget_newer_than(self, iteration: int) -> None:
        """``load`` resumed ``iteration``: drop the local iterations newer than it (see :class:`TwoTiers`).

        Training goes on from ``iteration`` and saves those iterations again; the local pointer,
        which never moves backwards, would refuse them. The pointer goes first, so a crash half
        way leaves committed local iterations without a pointer, never a pointer to a missing one.
        """
        if not self._owns_local:
            return
        try:
            latest = pointer.read_pointer(self.local)
            if latest is None or latest <= iteration:
                return
            logger.warning(
                "resumed %s, older than the local tier's %s (not every rank could read it, or it was "
                "damaged): dropping the local iterations after %s under %s",
                layout.format_iteration(iteration),
                layout.format_iteration(latest),
                layout.format_iteration(iteration),
                self.local.url,
            )
            self.local.backend.call("rm", self.local.join(POINTER_NAME))
            deletion.discard_iterations(
                self.local, [i for i in layout.list_iterations(self.local) if i > iteration]
            )
        except (OSError, DcpFsspecError) as e:
            logger.warning(
                "could not drop the local iterations after %s under %s: %s",
                layout.format_iteration(iteration),
                self.local.url,
                e,
            )

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every rank's drain; every rank raises the error of any (the durable tier is behind).

        Raises:
            DrainError: the last drain failed.
            TimeoutError: ``timeout`` passed first.
        """
        error: Exception | None = None
        try:
            if self.replicator is not None:
                self.replicator.wait(timeout)
            self._drainer.wait(timeout)
        except (DrainError, TimeoutError) as e:
            error = e
        self._collectives.raise_if_any_failed(error)

    def choose(
        self, iteration: int | None, *, trust_checkpoint: bool
    ) -> tuple[TierChoice | None, int | None]:
        """Agree across ranks on the tier ``load`` reads: ``(choice, durable_latest)``.

        A collective: each rank looks at its own local tier; rank 0 reads the durable pointer (an
        unreadable one counts as none, logged, so the local tier still serves).
        """
        mine = readable_locally(self.local, trust_checkpoint=trust_checkpoint)
        per_rank = one_save_everywhere(self._collectives.all_gather(mine))

        def durable_pointer() -> int | None:
            try:
                return pointer.read_pointer(self.durable)
            except StorageError as e:
                logger.warning(
                    "cannot read the durable pointer %s (%s); looking at the local tier %s only",
                    pointer.pointer_url(self.durable),
                    e,
                    self.local.url,
                )
                return None

        durable_latest = self._collectives.run_on_rank0(durable_pointer)
        return choose_tier(durable_latest, per_rank, iteration=iteration), durable_latest

    def shares(self, iteration: int | None, *, trust_checkpoint: bool) -> Shares | None:
        """With replicas: agree on each rank's source and bring peers' replicas home (a
        collective, see :mod:`~dcp_fsspec.checkpoint.tiers.peer_restore`); None: read the durable tier."""
        assert self._peers is not None
        if self.replicator is not None:
            self.replicator.wait()  # a replication in flight uses the same group
        mine = readable_locally(self.local, trust_checkpoint=trust_checkpoint)
        return self._peers.shares(mine, iteration)

    def resumed_from_shares(self, iteration: int) -> None:
        """``load`` resumed ``iteration`` from the shares: drain it again if the durable tier was
        read and lacks it (when every share was local, the durable tier was not asked)."""
        assert self._peers is not None
        self.forget_newer_than(iteration)
        if self._peers.durable_latest is not None:
            self.resumed_locally(iteration, self._peers.durable_latest)
