"""The Checkpointer: save training state to any fsspec URL each k steps, and resume from it.

It composes the pieces and owns the options: ``state`` turns each keyword into a DCP state
dict; ``pipeline`` writes the staged state dicts as ``{save_dirname}/iter_…/{key}/``, commits the
iteration, moves the pointer and applies retention, here or (asynchronously) in ``background``;
``loading`` restores what ``resume`` decides to read; with a ``LocalTier``, ``tiers`` saves to the local tier
first and drains to ``save_dirname`` in the background. What stays here is validation, staging,
the calls into those pieces, and the callbacks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
import warnings
from types import TracebackType
from typing import Any

import torch.distributed as dist

from dcp_fsspec.checkpoint import state as state_mod
from dcp_fsspec.checkpoint.at_exit import EXIT_HOOK
from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.checkpoint.commit import layout, pointer, run_listing
from dcp_fsspec.checkpoint.events import Callback, CheckpointEvent, report, tensor_nbytes
from dcp_fsspec.checkpoint.load.pipeline import LoadPipeline
from dcp_fsspec.checkpoint.load.resume import MODEL_KEY
from dcp_fsspec.checkpoint.options import LocalTier, ResumeOptions
from dcp_fsspec.checkpoint.save.async_saves import AsyncSaves, InFlight
from dcp_fsspec.checkpoint.save.background import leave_if_reimported_main
from dcp_fsspec.checkpoint.save.pipeline import Saved, SavePipeline, SaveSettings
from dcp_fsspec.checkpoint.tiers.tiered import LOCAL, TwoTiers
from dcp_fsspec.storage.settings import ReaderSettings, WriterSettings
from dcp_fsspec.storage.transport.gc_pause import collector_paused
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, RetryPolicy
from dcp_fsspec.storage.transport.urls import resolve

logger = logging.getLogger(__name__)

ASYNC_DISABLED = "disabled"
ASYNC_PINNED = "async_with_pinned_mem"
ASYNC_MODES = (ASYNC_DISABLED, ASYNC_PINNED)


def _check_async_mode(async_mode: str) -> None:
    """Refuse an unknown mode. In a process that ``spawn`` started re-running an unguarded main
    script, exit before anything touches storage (:func:`~dcp_fsspec.checkpoint.save.background.leave_if_reimported_main`)."""
    if async_mode not in ASYNC_MODES:
        raise ValueError(f"async_mode={async_mode!r} is not supported; choose one of {list(ASYNC_MODES)}")
    if async_mode == ASYNC_PINNED:
        leave_if_reimported_main()


class Checkpointer:
    """Saves and resumes training state under one URL, one folder per iteration.

    Every rank calls every method except :meth:`latest_checkpoint`, which any rank may call
    alone. Without an initialized process group it works in a single process.

    Args:
        save_dirname: where iterations go: any fsspec URL (``s3://bucket/run/ckpt``) or local path.
        storage_options: fsspec options for ``save_dirname`` (credentials, endpoint).
        async_mode: ``"disabled"``: :meth:`save` returns once the checkpoint is committed.
            ``"async_with_pinned_mem"``: :meth:`save` copies the state into reusable staging
            buffers (shared memory, pinned for CUDA tensors) and returns; a background process
            writes every key, commits and applies retention. At most one save is in flight: a
            :meth:`save` waits for the previous one first. Errors from the background surface at
            the next :meth:`save`, :meth:`wait` or :meth:`finalize`. The process starts here,
            without waiting for it; :meth:`prepare` allocates the buffers before the first save.
        keep_last_n: keep this many newest committed iterations, delete older ones after each
            save; ``None`` keeps everything. An older iteration is uncommitted before ``save()``
            returns; its files are deleted on a thread of their own (done by the next
            ``save()``, :meth:`wait` or :meth:`finalize`).
        resume: what :meth:`load` restores and from where (``load_path``, strictness, keys to
            skip, whether a fresh start is allowed); default ``ResumeOptions()``.
        local_tier: a fast local tier each save commits to first, drained to ``save_dirname``
            in the background (:class:`LocalTier`); ``None``: save to ``save_dirname`` directly.
        overwrite: allow saving an iteration that is already committed. It is deleted first, so
            if that save then dies, the pointer may name a missing folder and :meth:`load` says so.
        process_group: the group the checkpoint spans; default: every rank.
        verify_before_commit: before the pointer moves, rank 0 reads back every file of the
            iteration and checks every tensor's CRC-32 (costs one full read of the checkpoint).
        incremental: a tensor whose bytes equal those of the last committed iteration is not
            written again: the new iteration refers to the stored bytes (a frozen base, an
            adapter fine-tune). Retention keeps what kept iterations refer to; ``dcp-fsspec cp``
            makes a self-contained copy. See docs/incremental.md.
        on_event: called with each :class:`CheckpointEvent`: ``save_start``, ``save_end`` (once
            committed; for asynchronous saves when the training process next learns of it),
            ``load_end``, and with a local tier ``drain_end`` (in the drain thread, on rank 0, its
            ``error`` set if the drain failed). Each end is also logged as one line.
        retry: how every storage call (writers, readers, commit, pointer, retention) is retried
            (see :class:`~dcp_fsspec.storage.transport.retry.RetryPolicy`); ``None``: only the driver's own
            retries.
        writer_settings: the tuning of every writer, the background process's included, and the
            one place to ask for compression (``WriterSettings(compression="zstd")``); default
            ``WriterSettings()`` (:mod:`dcp_fsspec.storage.settings`).
        reader_settings: the tuning of every reader, and whether what :meth:`load` reads
            (``save_dirname`` and ``load_path``) is trusted
            (``ReaderSettings(trust_checkpoint=True)``); default ``ReaderSettings()``.

    Raises:
        ValueError: an unknown ``async_mode``, or ``keep_last_n`` below 1.
        InvalidURLError, MissingDriverError: see :func:`dcp_fsspec.storage.transport.urls.resolve`.
    """

    # Its keywords are the public API; CheckpointerOptions holds them as one value.
    def __init__(  # noqa: PLR0913
        self,
        save_dirname: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        async_mode: str = ASYNC_DISABLED,
        keep_last_n: int | None = None,
        resume: ResumeOptions | None = None,
        local_tier: LocalTier | None = None,
        overwrite: bool = False,
        process_group: dist.ProcessGroup | None = None,
        verify_before_commit: bool = False,
        incremental: bool = False,
        on_event: Callback | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        writer_settings: WriterSettings | None = None,
        reader_settings: ReaderSettings | None = None,
    ) -> None:
        _check_async_mode(async_mode)
        if keep_last_n is not None and (
            isinstance(keep_last_n, bool) or not isinstance(keep_last_n, int) or keep_last_n < 1
        ):
            raise ValueError(f"keep_last_n must be None (keep all) or an int >= 1, got {keep_last_n!r}")
        resume = resume or ResumeOptions()
        for key in resume.keys_not_to_resume:
            layout.check_key(key)
        self._root = resolve(save_dirname, storage_options, retry=retry)
        self._on_event = on_event
        self._collectives = Collectives(process_group)
        self._tiers = None if local_tier is None else self._two_tiers(local_tier, keep_last_n, retry)
        # Where save() commits: save_dirname, or this rank's local tier (whose retention TwoTiers
        # applies), over the ranks that tier spans.
        self._save_root = self._root if self._tiers is None else self._tiers.local
        save_collectives = self._collectives if self._tiers is None else self._tiers.save_collectives
        load_options = (
            resume.load_storage_options if resume.load_storage_options is not None else storage_options
        )
        self._loading = LoadPipeline(
            self._root,
            load_root=None
            if resume.load_path is None
            else resolve(resume.load_path, load_options, retry=retry),
            collectives=self._collectives,
            options=resume,
            reader_settings=reader_settings or ReaderSettings(),
            retry=retry,
            tiers=self._tiers,
            on_event=on_event,
        )
        self._save_settings = SaveSettings(
            self._save_root.secret_url,  # the background process connects by itself: keep the password
            dict((storage_options if local_tier is None else local_tier.storage_options) or {}),
            keep_last_n=keep_last_n if local_tier is None else None,
            overwrite=overwrite,
            verify_before_commit=verify_before_commit,
            incremental=incremental,
            retry=retry,
            writer=writer_settings or WriterSettings(),
        )
        self._pipeline = SavePipeline(self._save_settings, save_collectives, purge_in_background=True)
        self._closed = False
        self._async: AsyncSaves | None = None
        if async_mode == ASYNC_PINNED:
            self._async = AsyncSaves(
                self._save_settings,
                self._pipeline,
                self._save_root,
                save_collectives,
                lambda: EXIT_HOOK.register(self),
            )
            # Start the background process now, without waiting for it: its imports overlap the
            # training steps before the first save(), which waits only if it is not up yet.
            self._async.start()

    def _two_tiers(
        self, local_tier: LocalTier, keep_last_n: int | None, retry: RetryPolicy | None
    ) -> TwoTiers:
        tiers = TwoTiers(
            resolve(local_tier.dirname, local_tier.storage_options, retry=retry),
            self._root,
            self._collectives,
            keep_last_n_local=local_tier.keep_last_n,
            keep_last_n=keep_last_n,
            drain=local_tier.drain,
            replicas=local_tier.replicas,
            node=local_tier.node,
            on_drain_end=lambda event: report(event, self._on_event),
        )
        EXIT_HOOK.register(self)  # a drain in flight at exit is waited for
        return tiers

    @property
    def url(self) -> str:
        """``save_dirname``, normalized (local paths made absolute)."""
        return self._root.url

    # -- saving -------------------------------------------------------------------------------

    def save(self, iteration: int, **state: Any) -> None:
        """Save every keyword as ``{save_dirname}/iter_{iteration:09d}/{key}/`` and commit it.

        Returns once the iteration is committed and the pointer names it (unless a newer one
        was already named; the pointer never moves backwards). With a ``local_tier``, that is
        the local tier's commit and pointer; the durable copy follows in the background.

        Args:
            iteration: the training iteration, >= 0.
            **state: key → module, optimizer, scheduler, Stateful or dict (see ``state``).

        Raises:
            CheckpointExistsError: the iteration is committed already, or the pointer names a
                newer one, and ``overwrite`` is False.
            StorageError: the backend failed; nothing was committed.
            ValueError, TypeError: a bad iteration, key name or value (on every rank, before
                anything is written).
        """
        self._check_open("save")
        layout.format_iteration(iteration)
        if not state:
            raise ValueError("save() needs at least one key, e.g. save(iteration, model=model)")
        for key in state:
            layout.check_key(key)
        start = time.perf_counter()
        if self._async is not None:
            # The previous save must be done before its buffers are overwritten.
            self._async.start()
            self._wait_local()
        state_dicts = self._stage(state)
        done = InFlight(iteration, tuple(state_dicts), tensor_nbytes(state_dicts), start)
        self._report("save_start", done.iteration, done.keys, done.nbytes)
        if self._async is not None:
            self._async.submit(iteration, state_dicts, self._save_token(), done)
            return
        saved = self._pipeline.run(iteration, state_dicts, self._save_token())
        self._committed(dataclasses.replace(done, saved=saved))

    def prepare(self, **state: Any) -> None:
        """Allocate the staging buffers of an asynchronous save of ``state``, off this thread.

        Call it once the state exists (after :meth:`load`, with the keywords of :meth:`save`);
        it returns at once. The first save then copies into buffers already in memory, as later
        ones do, and waits for the allocation only if it is not done yet.
        Without ``async_mode="async_with_pinned_mem"`` it does nothing. Every rank calls it.

        Raises:
            ValueError, TypeError: a bad key name; asynchronously, a bad value too (on every rank).
        """
        self._check_open("prepare")
        for key in state:
            layout.check_key(key)
        if self._async is not None:
            self._async.prepare(self._stage(state))

    def wait(self, timeout: float | None = None) -> None:
        """Block until the asynchronous save in flight (if any) is committed; raise its error.

        Also wait until the files of iterations retention let go of are deleted; with
        ``local_tier``, until the drain to ``save_dirname`` is done.

        Raises:
            TimeoutError: ``timeout`` seconds passed first; the save is still in flight.
            DrainError: the last drain failed: ``save_dirname`` is behind the local tier.
        """
        self._wait_local(timeout)
        self._pipeline.wait_for_purge()
        if self._tiers is not None:
            self._tiers.wait(timeout)

    def _wait_local(self, timeout: float | None = None) -> None:
        """Wait for the asynchronous save in flight; with a local tier, then start its drain."""
        done = None if self._async is None else self._async.wait(timeout)
        if done is not None:
            self._committed(done)

    def _committed(self, done: InFlight) -> None:
        """Report a committed save; with a local tier, start its drain."""
        self._report(
            "save_end", done.iteration, done.keys, done.nbytes, time.perf_counter() - done.started, done.saved
        )
        if self._tiers is not None:
            self._tiers.committed_locally(done.iteration)

    def _save_token(self) -> str | None:
        """The token of the next save when this rank saves alone (per node): one for every rank,
        from rank 0 (a collective), so a load tells the ranks' copies of one save from copies
        of the same iteration another run left on some node. ``None``: the pipeline draws it."""
        if self._tiers is None or not self._tiers.per_node:
            return None
        return self._collectives.run_on_rank0(lambda: uuid.uuid4().hex)

    def _report(
        self,
        kind: str,
        iteration: int,
        keys: tuple[str, ...],
        nbytes: int,
        seconds: float = 0.0,
        saved: Saved | None = None,
    ) -> None:
        url = self._save_root.url_of(layout.iteration_path(self._save_root, iteration))
        tier = None if self._tiers is None else LOCAL
        event = CheckpointEvent(kind, iteration, url, keys, nbytes, seconds, tier=tier)
        if saved is not None:
            event = dataclasses.replace(
                event, written_bytes=saved.written_bytes, referenced_bytes=saved.referenced_bytes
            )
        report(event, self._on_event)

    def _stage(self, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Every key's state dict; every rank learns if any rank failed, before any write."""
        staged: dict[str, dict[str, Any]] = {}
        error: Exception | None = None
        try:
            staged = {k: state_mod.state_dict_for(k, v, model=state.get(MODEL_KEY)) for k, v in state.items()}
        except Exception as e:  # re-raised below, on every rank
            error = e
        self._collectives.raise_if_any_failed(error)
        return staged

    # -- loading ------------------------------------------------------------------------------

    @collector_paused()
    def load(self, iteration: int | None = None, **state: Any) -> int:
        """Restore every keyword in place and return the iteration to continue from.

        In order: 1) the iteration ``latest_checkpoint.txt`` names under ``save_dirname``, every
        key given that it saved; 2) else ``resume.load_path`` (``model`` only, also ``scheduler`` with
        ``only_load_scheduler_state``, or every key with ``load_training_state``); 3) else
        nothing: a fresh run, iteration 0, logged at WARNING with the URL (at INFO with
        ``ResumeOptions(missing_ok=True)`` where ``save_dirname`` is empty or absent). The rules
        in full: :mod:`~dcp_fsspec.checkpoint.load.resume`.

        Args:
            iteration: resume this committed iteration of ``save_dirname`` instead of the
                latest (``dcp-fsspec ls URL`` lists them), e.g. after the latest was damaged.
            **state: key → the live object to restore into, as for :meth:`save`.

        Returns:
            The iteration resumed (0 for a fresh run or for initial weights from ``load_path``).

        Raises:
            ValueError: ``keys_not_to_resume`` names a key not given here.
            CheckpointNotFoundError: the pointer (or ``iteration``) names a missing or uncommitted
                folder, or (with ``ResumeOptions.strict``) the checkpoint lacks a key given here.
            CorruptCheckpointError: the pointer does not hold an iteration folder name.
            CheckpointMismatchError: a key's tensors do not fit the live objects.
            CorruptCheckpointError: a file of the checkpoint is damaged; the message names the
                previous committed iteration to load instead.
        """
        self._check_open("load")
        if iteration is not None:
            layout.format_iteration(iteration)
        self._wait_local()  # an asynchronous save in flight lands first
        return self._loading.run(iteration, state)

    # -- inspection and lifetime --------------------------------------------------------------

    def latest_checkpoint(self) -> str | None:
        """The folder name the pointer holds (``"iter_000000010"``), or None before any save.

        Any rank may call it alone. It does not check that the folder is committed.

        Raises:
            CorruptCheckpointError: the pointer does not hold an iteration folder name.
        """
        latest = pointer.read_pointer(self._root)
        return None if latest is None else layout.format_iteration(latest)

    def committed_iterations(self) -> list[int]:
        """Every committed iteration under ``save_dirname``, ascending. Any rank may call it."""
        return run_listing.committed_iterations(self._root)

    def finalize(self) -> None:
        """Finish pending work and release resources; later saves and loads are errors.

        Safe to call twice. The ``with`` statement calls it on exit. With a ``local_tier`` it
        waits for the drain, and raises :class:`~dcp_fsspec.errors.DrainError` if it failed.
        """
        if not self._closed:
            self._closed = True
            try:
                if self._async is not None or self._tiers is not None:
                    try:
                        self.wait()
                    finally:
                        if self._async is not None:
                            self._async.close()
            finally:
                self._pipeline.wait_for_purge()
                self._collectives.close()

    def _finish_at_exit(self, timeout: float) -> None:
        """At interpreter exit: let the save in flight commit (within ``timeout``), then finalize.

        A script that ends without :meth:`finalize` or a ``with`` block would otherwise lose its
        last asynchronous save; it is waited for here, and named in the log either way.
        """
        if self._closed:
            return
        if self._async is not None and self._async.in_flight is not None:
            iteration = self._async.in_flight.iteration
            logger.warning(
                "the interpreter is exiting while iteration %d is being saved to %s; waiting up to %.0f s "
                "for it to commit (call finalize() or use a `with` block to wait where you choose)",
                iteration,
                self.url,
                timeout,
            )
            try:
                self.wait(timeout)
            except TimeoutError:
                logger.error(
                    "iteration %d was NOT committed to %s: its save did not finish within %.0f s of the "
                    "interpreter exiting; the pointer still names the previous checkpoint",
                    iteration,
                    self.url,
                    timeout,
                )
                return
            except Exception as e:  # noqa: BLE001 - the interpreter is exiting; the log is all that is left
                logger.error("iteration %d was NOT committed to %s: %s", iteration, self.url, e)
        try:
            self.finalize()
        except Exception as e:  # noqa: BLE001 - as above
            logger.warning("could not finalize the Checkpointer for %s at exit: %s", self.url, e)

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or getattr(self, "_async", None) is None:
            return
        warnings.warn(
            f"the Checkpointer for {self.url} was never finalized; call finalize() or use it in a "
            "`with` block, or an asynchronous save may be lost",
            ResourceWarning,
            stacklevel=2,
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finalize()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {what}: the Checkpointer for {self.url} was finalized")
