"""Two tiers: a fast ``local_dirname`` every save commits to first, and the durable ``save_dirname``.

:class:`TwoTiers` is what the Checkpointer holds when it is given ``local_dirname``: after each
local commit it hands the iteration, with its save's token, to every rank's
:class:`~.drain.Drainer` (each copies the files it wrote; under ``drain="latest"`` the ranks agree
first on which waiting iterations to drop), applies the local retention (``keep_last_n_local``;
never an iteration still to drain, never the newest), and warns if the last drain failed; at
``wait`` it waits for every rank's drain and raises any rank's error on every rank. These steps
run in the caller's thread, so their collectives never overlap training's. For ``load`` it
decides which tier to read, as a pure function of a few facts (:func:`choose_tier`): the newest
iteration committed in at least one tier that every rank can read, read from the local tier
where every rank has it committed and complete there.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Collection, Sequence

from ..errors import CorruptCheckpointError, DcpFsspecError, DrainError, InvalidURLError, StorageError
from ..storage.names import POINTER_NAME
from ..storage.urls import Location
from . import commit, layout, retention
from ._collectives import Collectives
from .drain import DRAIN_LATEST, Drainer, DrainJob
from .events import CheckpointEvent

logger = logging.getLogger(__name__)

LOCAL = "local"
DURABLE = "durable"


def choose_tier(
    durable_latest: int | None, local_per_rank: Sequence[Collection[int]], *, iteration: int | None = None
) -> tuple[int, str] | None:
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
        return (iteration, LOCAL) if iteration in everywhere else (iteration, DURABLE)
    newest_local = max(everywhere, default=None)
    if newest_local is not None and (durable_latest is None or newest_local >= durable_latest):
        return newest_local, LOCAL
    return None if durable_latest is None else (durable_latest, DURABLE)


def readable_locally(local: Location, *, trust_checkpoint: bool) -> list[int]:
    """This rank's committed local iterations whose keys are all there (their ``.metadata``
    carries the save's token and names files present), ascending. A local tier that cannot be
    read counts as empty (logged): the durable one is there for that."""
    try:
        listing = commit.list_save_dirname(local)
        readable = []
        for iteration in listing.folders:
            record = commit.listed_record(local, listing, iteration)
            if record is None:
                continue
            try:
                commit.require_saved_together(local, record, trust_checkpoint=trust_checkpoint)
            except CorruptCheckpointError as e:
                logger.warning("not resuming from the local copy %s: %s", layout.format_iteration(iteration), e)
                continue
            readable.append(iteration)
        return readable
    except (OSError, DcpFsspecError) as e:
        logger.warning("cannot read the local tier %s (%s); resuming from the durable tier", local.url, e)
        return []


class TwoTiers:
    """The local tier, the drain to the durable one, and the load decision between them.

    Every rank calls every method; every rank drains its own files; rank 0 alone commits the
    durable copy, prunes and reads the durable pointer.

    Args:
        local: the ``local_dirname`` location.
        durable: the ``save_dirname`` location.
        collectives: the ranks the checkpoint spans.
        keep_last_n_local: local retention (>= 1).
        keep_last_n: durable retention (``None``: keep all).
        drain: the drain policy (:data:`~.drain.DRAIN_EVERY` or :data:`~.drain.DRAIN_LATEST`).
        on_drain_end: called with each ``drain_end`` event.
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
    ) -> None:
        self.local = local
        self.durable = durable
        self._collectives = collectives
        self._keep_last_n_local = keep_last_n_local
        self._shared_checked = False
        # Rank 0 waits this long for the other ranks' copies once its own is done: their shares are
        # about the size of its own, so the retry deadline (a bound on one stuck call) is ample.
        marker_wait = durable.retry.deadline if durable.retry is not None and durable.retry.deadline else 600.0
        self._drainer = Drainer(
            local, durable, policy=drain, keep_last_n=keep_last_n, on_end=on_drain_end,
            rank=collectives.rank, world_size=collectives.world_size, marker_wait=marker_wait,
        )  # fmt: skip

    def check_shared(self) -> None:
        """Before the first save: refuse a ``local_dirname`` that is not one folder for every rank.

        A collective, once per Checkpointer: rank 0 writes a probe file into the local tier and
        every rank looks for it. The local save commits like a direct one (rank 0 checks that
        every file each key's ``.metadata`` names is there), so a folder each node has to
        itself (per-node NVMe) would fail that check on the first save with a misleading error.

        Raises:
            InvalidURLError: on every rank, naming the folder and the ranks that cannot see it.
        """
        if self._shared_checked or not self._collectives.distributed:
            return

        def write_probe() -> tuple[str, str]:
            name = f".dcp-fsspec-probe-{uuid.uuid4().hex[:12]}"
            self.local.backend.make_folder(self.local.path)
            self.local.backend.write_small_atomic(self.local.join(name), b"")
            return name, self.local.url

        # Each rank looks in its own local_dirname (ranks may be given different paths).
        name, rank0_url = self._collectives.run_on_rank0(write_probe)
        path = self.local.join(name)
        self.local.backend.invalidate(self.local.path)
        try:
            mine = commit.exists(self.local, path)
        except (OSError, DcpFsspecError):
            mine = False  # a folder this rank cannot read is no folder it shares; the error says so
        seen = self._collectives.all_gather(mine)  # every rank gets here: no rank raises alone
        if self._collectives.rank == 0:
            try:
                self.local.backend.call("rm", path)
            except (OSError, DcpFsspecError) as e:
                logger.info("could not remove the probe %s (harmless): %s", self.local.url_of(path), e)
        blind = [rank for rank, saw in enumerate(seen) if not saw]
        if blind:
            raise InvalidURLError(
                f"local_dirname: rank(s) {blind} cannot see the file rank 0 wrote into {rank0_url} in theirs (a "
                f"disk of their own; this rank's: {self.local.url}); the local tier must be one folder every rank "
                "sees (one node's disk, or a shared file system), as rank 0 commits each local save. Per-node "
                "local disks are not supported yet: give every rank the same shared folder, or drop local_dirname"
            )
        self._shared_checked = True

    def committed_locally(self, iteration: int) -> None:
        """``iteration`` is committed in the local tier: drain it, then prune the local tier.

        If the last drain failed, say so (a WARNING naming both tiers): this one tries again.
        """
        failure = self._submit(iteration)
        if failure is not None:
            logger.warning(
                "the durable tier %s is behind the local tier %s: %s. Training goes on: %s is committed "
                "locally and is being drained", self.durable.url, self.local.url, failure,
                layout.format_iteration(iteration),
            )  # fmt: skip
        if self._collectives.rank == 0:
            retention.apply_retention(
                self.local, self._keep_last_n_local, protected=self._drainer.undrained() | {iteration}
            )

    def _submit(self, iteration: int) -> DrainError | None:
        """Hand the committed local ``iteration`` to every rank's drainer (a collective).

        Rank 0 reads the save's token from the local commit record; under ``drain="latest"``
        the ranks drop only the waiting iterations that every rank still has waiting, so no
        rank commits, or waits for, an iteration another rank dropped or started.
        """
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
            record = commit.read_commit_record(self.local, iteration)
        except (OSError, DcpFsspecError) as e:
            logger.warning("cannot read the local commit record of %s under %s: %s",
                           layout.format_iteration(iteration), self.local.url, e)  # fmt: skip
            return ""
        return "" if record is None or record.save_id is None else record.save_id

    def resumed_locally(self, iteration: int, durable_latest: int | None) -> None:
        """``load`` read ``iteration`` from the local tier: drain it if the durable tier lacks it
        (a drain that a killed run left unfinished)."""
        if durable_latest is None or durable_latest < iteration:
            if self._collectives.rank == 0:
                logger.info("%s is newer than the durable tier %s: draining it again",
                            layout.format_iteration(iteration), self.durable.url)  # fmt: skip
            self._submit(iteration)

    def forget_newer_than(self, iteration: int) -> None:
        """``load`` resumed ``iteration``: drop the local iterations newer than it (rank 0).

        Training goes on from ``iteration`` and saves those iterations again; the local pointer,
        which never moves backwards, would refuse them. The pointer goes first, so a crash half
        way leaves committed local iterations without a pointer, never a pointer to a missing one.
        """
        if self._collectives.rank != 0:
            return
        try:
            latest = commit.read_pointer(self.local)
            if latest is None or latest <= iteration:
                return
            logger.warning(
                "resumed %s, older than the local tier's %s (not every rank could read it, or it was "
                "damaged): dropping the local iterations after %s under %s", layout.format_iteration(iteration),
                layout.format_iteration(latest), layout.format_iteration(iteration), self.local.url,
            )  # fmt: skip
            self.local.backend.call("rm", self.local.join(POINTER_NAME))
            for newer in (i for i in layout.list_iterations(self.local) if i > iteration):
                commit.discard_iteration(self.local, newer)
        except (OSError, DcpFsspecError) as e:
            logger.warning("could not drop the local iterations after %s under %s: %s", layout.format_iteration(iteration),
                           self.local.url, e)  # fmt: skip

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every rank's drain; every rank raises the error of any (the durable tier is behind).

        Raises:
            DrainError: the last drain failed.
            TimeoutError: ``timeout`` passed first.
        """
        error: Exception | None = None
        try:
            self._drainer.wait(timeout)
        except (DrainError, TimeoutError) as e:
            error = e
        self._collectives.raise_if_any_failed(error)

    def choose(self, iteration: int | None, *, trust_checkpoint: bool) -> tuple[tuple[int, str] | None, int | None]:
        """Agree across ranks on the tier ``load`` reads: ``(choice, durable_latest)``.

        A collective: each rank looks at its own local tier; rank 0 reads the durable pointer (an
        unreadable one counts as none, logged, so the local tier still serves).
        """
        mine = readable_locally(self.local, trust_checkpoint=trust_checkpoint)
        per_rank = self._collectives.all_gather(mine)

        def durable_pointer() -> int | None:
            try:
                return commit.read_pointer(self.durable)
            except StorageError as e:
                logger.warning("cannot read the durable pointer %s (%s); looking at the local tier %s only",
                               commit.pointer_url(self.durable), e, self.local.url)  # fmt: skip
                return None

        durable_latest = self._collectives.run_on_rank0(durable_pointer)
        return choose_tier(durable_latest, per_rank, iteration=iteration), durable_latest
