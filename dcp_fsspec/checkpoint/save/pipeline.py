"""The save pipeline: what happens to staged state until it is a committed, named iteration.

One save, read top to bottom in :meth:`SavePipeline.run`:

1. Rank 0 prepares the iteration's folder (:func:`~dcp_fsspec.checkpoint.commit.committing.prepare_iteration`). It refuses to
   replace a committed one. A folder that holds anything is taken over with a mark that another
   save's commit cannot pass, then cleared.
2. Every rank writes every key with :class:`~dcp_fsspec.storage.write.writer.FsspecStorageWriter`.
   A small state on one rank goes to an object store all keys at once; on local disk the keys go
   one after another, each file's fsync on a thread of its own.
3. Rank 0 commits and moves the pointer (:func:`~dcp_fsspec.checkpoint.commit.committing.publish`).
4. Rank 0 applies retention from what step 1 read (:class:`~dcp_fsspec.checkpoint.commit.run_listing.Survey`). It uncommits old
   iterations; a Checkpointer's own pipeline deletes their files on a thread, which the next save
   waits for.

The pointer is read twice per save: in step 1 and in step 3's compare-and-swap. A synchronous
save, the background process of an asynchronous one and the thread that stands in for it run
this same code, each building it from a picklable :class:`SaveSettings`.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.checkpoint.commit import committing, layout, retention, run_listing
from dcp_fsspec.checkpoint.commit.at_once import at_once
from dcp_fsspec.checkpoint.events import tensor_nbytes
from dcp_fsspec.errors import CorruptCheckpointError
from dcp_fsspec.storage.checkpoint_files.integrity import verify_checkpoint
from dcp_fsspec.storage.format.content_hashes import unhashed
from dcp_fsspec.storage.format.references import is_reference
from dcp_fsspec.storage.settings import WriterSettings
from dcp_fsspec.storage.transport.error_wrapping import unwrap_dcp
from dcp_fsspec.storage.transport.file_syncs import FileSyncs
from dcp_fsspec.storage.transport.gc_pause import collector_paused
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, RetryPolicy
from dcp_fsspec.storage.transport.urls import resolve
from dcp_fsspec.storage.write.file_plan import WriteContext
from dcp_fsspec.storage.write.writer import FsspecStorageWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveSettings:
    """Everything a save needs besides the state; picklable, so a background process can save.

    Args:
        url: ``save_dirname``, normalized (a local path made absolute, once, by the caller).
        storage_options: fsspec options for ``url``.
        keep_last_n: how many committed iterations retention keeps; ``None`` keeps all.
        overwrite: an iteration that is already committed may be replaced.
        verify_before_commit: rank 0 re-reads every key and checks every CRC-32 before the commit.
        incremental: a record whose bytes the last committed iteration holds is not written
            again; the new key's ``.metadata`` refers to them (:mod:`~dcp_fsspec.storage.format.content_hashes`).
        retry: how storage calls are retried (every writer's and the commit's).
        writer: the tuning of every :class:`FsspecStorageWriter`.
    """

    url: str = field(repr=False)  # the real URL (a password in it reaches the driver, never a message)
    storage_options: dict[str, Any] = field(default_factory=dict)
    keep_last_n: int | None = None
    overwrite: bool = False
    verify_before_commit: bool = False
    incremental: bool = False
    retry: RetryPolicy | None = DEFAULT_RETRY
    writer: WriterSettings = WriterSettings()


class Saved(NamedTuple):
    """What one save did, as this rank saw it.

    Attributes:
        latest: the iteration the pointer names afterwards.
        written_bytes: the record bytes this rank wrote (after compression, if any).
        referenced_bytes: the record bytes this rank's keys refer to in older iterations
            instead of writing them again (an incremental save's; else 0).
    """

    latest: int
    written_bytes: int
    referenced_bytes: int


class SavePipeline:
    """Writes staged state dicts as one iteration, commits it, moves the pointer, prunes.

    Every rank of ``collectives`` calls :meth:`run` with the same iteration and keys.

    Args:
        settings: where and how to save.
        collectives: the ranks the checkpoint spans (a background process passes its own group).
        purge_in_background: retention deletes old iterations' files on a thread of its own
            (:class:`~dcp_fsspec.checkpoint.commit.retention.BackgroundPurge`), after uncommitting them in the save; the
            owner calls :meth:`wait_for_purge` before it closes. ``False`` (a background save
            process, already off the training thread): in the save.
    """

    def __init__(
        self, settings: SaveSettings, collectives: Collectives, *, purge_in_background: bool = False
    ) -> None:
        self.settings = settings
        self._root = resolve(settings.url, settings.storage_options, retry=settings.retry)
        self._collectives = collectives
        self._purge = retention.BackgroundPurge() if purge_in_background else None
        self._survey: run_listing.Survey | None = None  # rank 0: what retention needs, read early

    def wait_for_purge(self) -> None:
        """Return once the files retention let go of in the last save are deleted (or the
        failure is logged)."""
        if self._purge is not None:
            self._purge.wait()

    @collector_paused()
    def run(self, iteration: int, staged: dict[str, dict[str, Any]], save_id: str | None = None) -> Saved:
        """Save ``staged`` (key → state dict) as ``iteration`` and commit it.

        ``save_id``: the save's token, when the caller chose it (ranks saving their per-node
        local copies alone share one, see :mod:`~dcp_fsspec.checkpoint.tiers.tiered`); else rank 0 draws one.

        Returns:
            The iteration the pointer names afterwards (``iteration``, or a newer one when
            ``overwrite`` replaced an older iteration), and the bytes this rank wrote and referred to.

        Raises:
            CheckpointExistsError: the iteration is committed already, or the pointer names a
                newer one, and ``overwrite`` is False; or another process saving the same
                iteration into ``url`` finished or committed first (this save is not committed).
            CorruptCheckpointError: ``verify_before_commit`` found damage; nothing was committed.
            StorageError: the backend failed; nothing was committed.
        """
        keys = tuple(staged)
        self.wait_for_purge()  # the last save's old iterations: this one may write into one of them
        # The save's token, from rank 0 to every rank: in every data file's name and every
        # key's .metadata, and checked at the commit, so a save commits only what it wrote.
        prepared = self._collectives.run_on_rank0(
            lambda: self._prepare(iteration, save_id or uuid.uuid4().hex)
        )
        syncs, counts = self._write_keys(iteration, staged, prepared, unique_file_names=not prepared.claimed)
        latest = self._publish(iteration, keys, prepared, syncs)
        if self.settings.keep_last_n is not None and self._collectives.rank == 0:
            survey, self._survey = self._survey, None
            retention.apply_retention(
                self._root,
                self.settings.keep_last_n,
                protected=(iteration,),
                latest=latest,
                purge=self._purge,
                survey=survey,
                committed_now=iteration,
            )
        return Saved(latest, sum(c.written for c in counts), sum(c.referenced for c in counts))

    def _prepare(self, iteration: int, save_id: str) -> committing.Prepared:
        """Rank 0: make the iteration's folder this save's (:func:`~dcp_fsspec.checkpoint.commit.committing.prepare_iteration`);
        keep what it read for retention, which only rank 0 applies."""
        prepared, self._survey = committing.prepare_iteration(
            self._root,
            iteration,
            save_id,
            overwrite=self.settings.overwrite,
            keep_last_n=self.settings.keep_last_n,
            incremental=self.settings.incremental,
        )
        return prepared

    def _write_keys(
        self,
        iteration: int,
        staged: dict[str, dict[str, Any]],
        prepared: committing.Prepared,
        *,
        unique_file_names: bool,
    ) -> tuple[FileSyncs | None, list[_CountingWriter]]:
        """Write every key: side by side where :meth:`_keys_at_once` allows, else one after another.

        Keys are independent DCP checkpoints, so a small save's time is its round trips, and
        writing the keys together makes them those of one key. If keys fail, the first one's
        error (in key order) is raised once every key has finished.

        Returns:
            Local disk: the fsyncs of the files written, still running on threads of their own
            (:class:`~dcp_fsspec.storage.transport.file_syncs.FileSyncs`) while the next key was planned
            and written, for :meth:`_sync_key_folders` to wait for; ``None`` elsewhere. And each
            key's writer, with the bytes it wrote and referred to.
        """
        writer = self.settings.writer
        syncs = self._root.backend.file_syncs(writer.files_per_rank) if writer.sync_files else None

        def write(key: str) -> _CountingWriter:
            return self._write_key(
                iteration, key, staged[key], prepared, unique_file_names=unique_file_names, syncs=syncs
            )

        try:
            if self._keys_at_once(staged):
                writers: list[_CountingWriter] = at_once([partial(write, key) for key in staged])
            else:
                writers = [write(key) for key in staged]
        except BaseException:
            if syncs is not None:
                syncs.wait(raise_errors=False)  # close the files; the key's error is the one to raise
            raise
        return syncs, writers

    def _keys_at_once(self, staged: dict[str, dict[str, Any]]) -> bool:
        """Whether the keys may be written side by side.

        Only without other ranks: DCP's collectives of two keys on one process group would
        interleave in a different order on each rank. Only where requests wait on a network: on
        local disk the keys' threads would contend for the GIL (more CPU than one after another),
        and the disk's flushes overlap the next key anyway (see
        :meth:`_write_keys`). And only while the whole state fits one writer's in-flight budget,
        so that several writers hold no more memory than one would.
        """
        return (
            len(staged) > 1
            and not self._root.answers_locally
            and not self._collectives.distributed
            and tensor_nbytes(staged) <= self.settings.writer.max_inflight_bytes
        )

    def _write_key(
        self,
        iteration: int,
        key: str,
        state_dict: dict[str, Any],
        prepared: committing.Prepared,
        *,
        unique_file_names: bool,
        syncs: FileSyncs | None,
    ) -> _CountingWriter:
        url = self._root.url_of(layout.key_path(self._root, iteration, key))
        base = prepared.base
        base_url = None
        if base is not None and key in base.keys:
            base_url = self._root.url_of(layout.key_path(self._root, base.iteration, key))
        context = WriteContext(
            fs=self._root.fs,  # the pipeline's own: not one built from the URL again per key
            save_id=prepared.save_id,
            unique_file_names=unique_file_names,
            # The commit record, not a key's .metadata, commits the save: the key's folder is
            # fsynced once, with the others', before it (:meth:`_sync_key_folders`).
            metadata_commits=False,
            file_syncs=syncs,
        )
        writer = _CountingWriter(
            url,
            settings=self.settings.writer,
            retry=self.settings.retry,
            incremental=self.settings.incremental,
            base=base_url,
            _context=context,
            # Not the storage writer's default (True, torch's): the iteration was cleared at
            # prepare, so a key's .metadata here now is another save's, and must stay: the
            # writer refuses before it writes a byte over that key's files.
            overwrite=False,
        )
        try:
            dcp.save(
                state_dict,
                storage_writer=writer,
                process_group=self._collectives.group,
                no_dist=not self._collectives.distributed,
            )
        except CheckpointException as e:
            raise unwrap_dcp(e, f"saving key {key!r} to {url}", mismatch=False) from e
        return writer

    def _publish(
        self, iteration: int, keys: tuple[str, ...], prepared: committing.Prepared, syncs: FileSyncs | None
    ) -> int:
        """Every rank finished every key and made its files and folders durable → rank 0 writes
        the commit record, then the pointer."""
        error: Exception | None = None
        try:
            self._sync_key_folders(iteration, keys, syncs)
        except Exception as e:  # noqa: BLE001 - every rank raises it, see raise_if_any_failed
            error = e
        self._collectives.raise_if_any_failed(error)

        def on_rank0() -> int:
            if self.settings.verify_before_commit:
                self._verify_keys(iteration, keys)
            latest = committing.publish(
                self._root,
                iteration,
                keys,
                self._collectives.world_size,
                behind_pointer=self.settings.overwrite,
                save_id=prepared.save_id,
                taken_over=prepared.taken_over,
            )
            logger.info("committed %s", self._root.url_of(layout.iteration_path(self._root, iteration)))
            return latest

        return self._collectives.run_on_rank0(on_rank0)

    def _sync_key_folders(self, iteration: int, keys: tuple[str, ...], syncs: FileSyncs | None) -> None:
        """Every rank, on local disk with ``sync_files``: wait for the files' fsyncs (``syncs``,
        running since each file was written), then fsync every key's folder, one after another.

        One fsync a key folder where the writers made two (after the data, after ``.metadata``),
        and back to back: on ext4 the first commits the journal with every key's renames in it
        and the others find little left. Every rank syncs, after
        DCP wrote ``.metadata``: no rank's renames rely on another node's fsync.
        """
        if syncs is not None:
            syncs.wait()
        if not self.settings.writer.sync_files:
            return
        for key in keys:
            self._root.backend.sync_folder(layout.key_path(self._root, iteration, key))

    def _verify_keys(self, iteration: int, keys: tuple[str, ...]) -> None:
        """Rank 0, before the commit: re-read every key's files and check every CRC-32."""
        for key in keys:
            url = self._root.url_of(layout.key_path(self._root, iteration, key))
            report = verify_checkpoint(url, fs=self._root.fs, retry=self.settings.retry)
            if not report.ok:
                raise CorruptCheckpointError(
                    f"not committing {self._root.url_of(layout.iteration_path(self._root, iteration))}: "
                    f"verifying key {key!r} found {len(report.problems)} problem(s), first: "
                    f"{report.problems[0]}; the pointer stays where it was — save again"
                )


class _CountingWriter(FsspecStorageWriter):
    """A storage writer that counts the record bytes this rank wrote, and those it referred to."""

    written: int = 0
    referenced: int = 0

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        done = super().write_data(plan, planner)
        for result in done.value():  # already set: the writer returns once its files are written
            info = unhashed(result.storage_data)
            if is_reference(info.relative_path):
                self.referenced += info.length
            else:
                self.written += info.length
        return done
