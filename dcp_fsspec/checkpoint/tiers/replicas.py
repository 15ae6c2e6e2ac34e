"""Replicas of the local tier on other nodes: where they sit, their manifest, and the thread that sends them.

Where they sit and what commits them: :mod:`~dcp_fsspec.checkpoint.tiers.replica_files`. A
replica without a manifest (its sender died half way) is never used, and the next transfer into
its folder clears it. A :class:`Replicator` thread on every rank sends each committed
local iteration to the ranks that hold its copies, over a process group of its own
(:mod:`~dcp_fsspec.checkpoint.tiers.peer_transfer`), and keeps the local tier's ``keep_last_n`` of each
rank's replicas.
"""

from __future__ import annotations

import logging
import posixpath
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.checkpoint.tiers.nodes import Ring
from dcp_fsspec.checkpoint.tiers.peer_transfer import Arrived, Folder, exchange
from dcp_fsspec.checkpoint.tiers.replica_files import (
    MANIFEST_NAME,
    Replica,
    replica_folder,
    replicas_of,
)
from dcp_fsspec.errors import DcpFsspecError
from dcp_fsspec.storage.format.crc import crc32
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME
from dcp_fsspec.storage.transport.urls import Location

logger = logging.getLogger(__name__)

_VERIFY_BYTES = 16 * 1024 * 1024


def verified(local: Location, replica: Replica) -> Folder | None:
    """The replica's files to send, once every byte matches its manifest's CRC-32; None (a
    WARNING naming the file) if one differs or cannot be read."""
    folder = replica_folder(local, replica.src, replica.iteration)
    for (name, size), want in zip(replica.files, replica.crcs, strict=True):
        path = posixpath.join(folder.path, name)
        crc, read = 0, 0
        try:
            with folder.fs.open(path, "rb") as f:
                while chunk := f.read(_VERIFY_BYTES):
                    crc = crc32(chunk, crc)
                    read += len(chunk)
        except (OSError, DcpFsspecError) as e:
            logger.warning(
                "the replica file %s cannot be read (%s): the next source is used", folder.url_of(path), e
            )
            return None
        if read != size or crc != want:
            logger.warning(
                "the replica file %s is damaged (%d bytes, CRC-32 %#010x; its manifest says %d bytes, %#010x): "
                "the next source is used",
                folder.url_of(path),
                read,
                crc,
                size,
                want,
            )
            return None
    return Folder(folder, replica.files, {"src": replica.src, "iteration": replica.iteration}, replica.crcs)


def own_folder(local: Location, iteration: int, about: Mapping[str, object]) -> Folder:
    """This rank's committed local ``iteration``, its commit record last (written last on arrival).

    Raises:
        StorageError: the listing failed.
    """
    folder = local.at(layout.iteration_path(local, iteration))
    prefix = folder.path.rstrip("/") + "/"
    found = local.backend.find(folder.path)
    files = sorted(
        (name[len(prefix) :], int(info.get("size") or 0))
        for name, info in found.items()
        if name.startswith(prefix) and info.get("type") != "directory"
    )
    files.sort(key=lambda f: f[0] == COMMIT_RECORD_NAME)
    return Folder(folder, tuple(files), dict(about))


def clear(folder: Location) -> None:
    """Remove ``folder`` and everything in it, its manifest first (so it is never half a replica)."""
    within = posixpath.dirname(folder.path.rstrip("/"))
    manifest = folder.join(MANIFEST_NAME)
    folder.backend.remove_files([manifest], within=within)
    folder.backend.remove_trees([folder.path], within=within)


def commit(folder: Location, replica: Replica) -> None:
    """Write the manifest: from now on the replica counts."""
    folder.backend.write_small_atomic(folder.join(MANIFEST_NAME), replica.to_json())


def prune(local: Location, src: int, keep_last_n: int) -> None:
    """Keep the newest ``keep_last_n`` replicas of rank ``src``; failures are logged."""
    held = replicas_of(local, src)
    try:
        iterations = layout.list_iterations(held)
        for iteration in iterations[:-keep_last_n]:
            clear(held.at(layout.iteration_path(held, iteration)))
    except (OSError, DcpFsspecError) as e:
        logger.warning("could not prune the replicas under %s: %s", held.url, e)


@dataclass(frozen=True)
class ReplicaJob:
    """One committed local iteration to send to its holders, with its save's token."""

    iteration: int
    token: str


class Replicator:
    """Every rank's thread that sends its committed local iterations to their holders.

    Every rank submits the same iterations in the same order (after each local commit), so the
    transfers of a ring step pair up. One job at a time: a submit waits for the one in flight.
    A failed replication is logged and never stops training.

    Args:
        local: this rank's local tier (its ``rank{r}`` folder).
        group: the replicas' own process group (every rank of the checkpoint).
        ring: the nodes and how many copies.
        rank, world_size: this rank in ``group``, and its size.
        keep_last_n: the local tier's retention, applied to each rank's replicas.
    """

    def __init__(
        self,
        local: Location,
        group: dist.ProcessGroup,
        ring: Ring,
        *,
        rank: int,
        world_size: int,
        keep_last_n: int,
    ) -> None:
        self._local = local
        self._group = group
        self._ring = ring
        self._rank = rank
        self._world_size = world_size
        self._keep_last_n = keep_last_n
        self._cond = threading.Condition()
        self._job: ReplicaJob | None = None
        self._running: int | None = None
        self.sent_bytes = 0

    def submit(self, job: ReplicaJob) -> None:
        """Replicate ``job`` once the job in flight is done."""
        with self._cond:
            self._cond.wait_for(lambda: self._job is None and self._running is None)
            self._job = job
            self._running = job.iteration
            threading.Thread(target=self._serve, name="dcp-fsspec-replicas", daemon=True).start()

    def busy(self) -> set[int]:
        """The iteration being sent: local retention keeps it."""
        with self._cond:
            return set() if self._running is None else {self._running}

    def wait(self, timeout: float | None = None) -> None:
        """Block until no replication is in flight.

        Raises:
            TimeoutError: ``timeout`` passed first.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._running is None, timeout):
                raise TimeoutError(f"replicating {self._local.url} did not finish within {timeout} s")

    def _serve(self) -> None:
        with self._cond:
            job = self._job
        assert job is not None
        try:
            for copy in range(1, self._ring.replicas):
                self._step(job, copy)
        except Exception as e:  # noqa: BLE001 - a failed replication must not stop training
            logger.warning(
                "replicating %s of %s failed: %r; its replicas are missing",
                layout.format_iteration(job.iteration),
                self._local.url,
                e,
            )
        finally:
            with self._cond:
                self._job = None
                self._running = None
                self._cond.notify_all()

    def _step(self, job: ReplicaJob, copy: int) -> None:
        """Send our copy ``copy`` to its holder while we receive the copy we hold of its sender."""
        holder, sender = self._ring.holder(self._rank, copy), self._ring.sender(self._rank, copy)
        about = {
            "src": self._rank,
            "iteration": job.iteration,
            "token": job.token,
            "world_size": self._world_size,
        }
        try:
            mine = own_folder(self._local, job.iteration, about)
        except (OSError, DcpFsspecError) as e:
            logger.warning("cannot list %s to replicate it: %s", self._local.url, e)
            mine = Folder(self._local, (), {**about, "error": str(e)})
        target = replica_folder(self._local, sender, job.iteration)
        clear(target)
        try:
            arrived = exchange(self._group, (holder, mine), (sender, target))
        except DcpFsspecError as e:  # a CRC-32 that differs, or a write that failed here
            logger.warning("the replica %s is refused: %s", target.url, e)
            clear(target)
            return
        self.sent_bytes += sum(size for _, size in mine.files)
        assert arrived is not None
        self._commit(target, sender, job, arrived)
        prune(self._local, sender, self._keep_last_n)

    def _commit(self, target: Location, sender: int, job: ReplicaJob, arrived: Arrived) -> None:
        about = arrived.about
        if about.get("error") or about.get("src") != sender or about.get("iteration") != job.iteration:
            logger.warning(
                "rank %d sent no replica of %s: %s", sender, layout.format_iteration(job.iteration), about
            )
            clear(target)
            return
        replica = Replica(
            sender,
            job.iteration,
            str(about.get("token")),
            int(about["world_size"]),
            arrived.files,
            arrived.crcs,
        )
        commit(target, replica)
