"""The Checkpointer: save training state to any fsspec URL each k steps, and resume from it.

It composes the pieces and owns the options: ``state`` turns each keyword into a DCP state
dict; ``pipeline`` writes the staged state dicts as ``{save_dirname}/iter_…/{key}/``, commits the
iteration, moves the pointer and applies retention, here or (asynchronously) in ``background``;
``resume`` decides what ``load`` reads; with ``local_dirname``, ``tiers`` saves to the local tier
first and drains to ``save_dirname`` in the background. What stays here is validation, staging,
the calls into those pieces, and the callbacks.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import (
    BackgroundSaveError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidURLError,
)
from ..storage.collector import collector_paused
from ..storage.failures import unwrap_dcp
from ..storage.retry import DEFAULT_RETRY, RetryPolicy
from ..storage.settings import ReaderSettings, WriterSettings
from ..storage.urls import Location, redact_url, resolve
from . import commit, layout, preflight, resume
from . import state as state_mod
from ._collectives import Collectives
from .at_once import at_once
from .background import BackgroundSaver, ThreadSaver
from .drain import DRAIN_EVERY, DRAIN_POLICIES
from .events import Callback, CheckpointEvent, report, tensor_nbytes
from .pipeline import SavePipeline, SaveSettings
from .resume import MODEL_KEY, KeyToLoad, ResumeOptions
from .staging import Stager
from .tiers import DURABLE, LOCAL, TwoTiers

logger = logging.getLogger(__name__)

ASYNC_DISABLED = "disabled"
ASYNC_PINNED = "async_with_pinned_mem"
ASYNC_MODES = (ASYNC_DISABLED, ASYNC_PINNED)
RESUME_MODES = ("auto", "required")
OPTIMIZER_KEY = "optim"


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
            the next :meth:`save`, :meth:`wait` or :meth:`finalize`.
        keep_last_n: keep this many newest committed iterations, delete older ones after each
            save; ``None`` keeps everything. An older iteration is uncommitted before ``save()``
            returns; its files are deleted on a thread of their own (done by the next
            ``save()``, :meth:`wait` or :meth:`finalize`).
        load_path: initial weights for a run with nothing under ``save_dirname`` yet: an
            iteration folder (``…/iter_000000100``), a ``save_dirname`` with a pointer, or a single
            DCP checkpoint of the model (its state dict, or ``{"model": state_dict}`` as
            ``dcp.save({"model": state})`` writes it: told apart by the names in its metadata).
        load_storage_options: fsspec options for ``load_path``; default ``storage_options``.
        load_training_state: with ``load_path``, load every key given to :meth:`load`, not only
            ``model``, and return the iteration in the folder's name.
        only_load_scheduler_state: with ``load_path``, load the ``scheduler`` key from it too,
            besides ``model`` (a new run that continues a schedule); :meth:`load` still returns 0.
        strict_resume: a key given to :meth:`load` that the checkpoint lacks is an error; with
            False it is skipped (logged), and so are entries missing inside a key.
        load_optimizer: False skips the ``optim`` key (and any other optimizer) on load.
        keys_not_to_resume: keys :meth:`load` leaves as they are.
        overwrite: allow saving an iteration that is already committed. It is deleted first, so
            if that save then dies, the pointer may name a missing folder and :meth:`load` says so.
        process_group: the group the checkpoint spans; default: every rank.
        verify_before_commit: before the pointer moves, rank 0 reads back every file of the
            iteration and checks every tensor's CRC-32 (costs one full read of the checkpoint).
        on_save_start, on_save_end, on_load_end: called with a :class:`CheckpointEvent` (bytes this
            rank moved, seconds, GB/s) when a save starts, once it is committed (for asynchronous
            saves: when the training process next learns of it), and after a load. Each end is
            also logged as one line.
        retry: how every storage call (writers, readers, commit, pointer, retention) is retried
            (see :class:`~dcp_fsspec.storage.retry.RetryPolicy`); ``None``: only the driver's own
            retries.
        writer_settings: the tuning of every writer, the background process's included; default
            ``WriterSettings()`` (:mod:`dcp_fsspec.storage.settings`).
        reader_settings: the tuning of every reader; default ``ReaderSettings()``.
        trust_checkpoint: what :meth:`load` reads (``save_dirname`` and ``load_path``) was written
            by you: unpickle ``.metadata`` and non-tensor entries in full, whatever classes they
            name, which runs any code they hold. By default only DCP metadata's classes, and for
            non-tensor entries what ``torch.load(weights_only=True)`` constructs (plain values,
            tensors, ``torch.serialization.add_safe_globals``), are loaded; anything else is a
            ``CorruptCheckpointError`` naming it. Its own keyword, not a ``ReaderSettings`` field:
            it is a decision about the checkpoint's source rather than tuning, and it governs the
            load planner (non-tensor entries) as well as the reader.
        compression: ``"zstd"`` compresses every record as torch's ``ZStandard`` extension does
            (torch's own readers load the checkpoint); needs ``pip install 'dcp-fsspec[zstd]'``.
            Loading needs nothing: the reader undoes what ``.metadata`` says each record went
            through. Shorthand for ``WriterSettings(compression=…)``.
        compression_level: the zstd level (default 3; 1 is fastest, 19+ smallest).
        local_dirname: a fast local tier (node-local disk; any fsspec URL or local path): each
            save is committed there first (same layout, its own pointer), then copied to
            ``save_dirname`` in the background (the *drain*: every rank copies the files it
            wrote); the durable pointer moves once that copy is committed. :meth:`load` resumes
            the newest iteration every rank can read, from the local tier where it is committed
            and complete there. One folder every rank sees (one node, or a shared file system)
            holds one checkpoint for all ranks; a folder each node has to itself (per-node
            NVMe at the same path; found by a probe at construction, logged) holds each rank's
            own copy of its share under ``rank{r}/``, and the drain merges them into one plain
            checkpoint. ``None``: save to ``save_dirname`` directly.
        local_storage_options: fsspec options for ``local_dirname``.
        keep_last_n_local: how many committed iterations the local tier keeps (>= 1); never one
            still to drain, nor the newest.
        drain: when saves come faster than drains: ``"every"``: :meth:`save` waits for the
            drain in flight, every iteration goes up; ``"latest"``: an iteration waiting to drain
            is replaced by the newer one (logged). A failed drain does not stop training: the next
            :meth:`save` warns and drains again; :meth:`wait` and :meth:`finalize` raise
            :class:`~dcp_fsspec.errors.DrainError` while the durable tier is behind.
        on_drain_end: called with a ``drain_end`` :class:`CheckpointEvent` (in the drain thread,
            on rank 0) after each drain, its ``error`` set if it failed.
        resume: what :meth:`load` does when there is nothing to resume (no pointer under
            ``save_dirname``, no ``load_path``). ``"auto"``: train from scratch, logged at WARNING
            with the URL. ``"required"``: raise :class:`~dcp_fsspec.errors.CheckpointNotFoundError`
            naming it (a job that must continue a run, never restart it).

    Raises:
        ValueError: an unknown ``async_mode``, ``drain`` or ``resume``, ``keep_last_n`` or
            ``keep_last_n_local`` below 1, or both ``load_training_state`` and
            ``only_load_scheduler_state``; an unknown ``compression``, or a
            ``compression_level`` without one.
        MissingDriverError: ``compression="zstd"`` without the ``zstandard`` package.
        InvalidURLError, MissingDriverError: see :func:`dcp_fsspec.storage.urls.resolve`.
    """

    def __init__(
        self,
        save_dirname: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        async_mode: str = "disabled",
        keep_last_n: int | None = None,
        load_path: str | os.PathLike[str] | None = None,
        load_storage_options: dict[str, Any] | None = None,
        load_training_state: bool = False,
        only_load_scheduler_state: bool = False,
        strict_resume: bool = True,
        load_optimizer: bool = True,
        keys_not_to_resume: tuple[str, ...] | list[str] = (),
        overwrite: bool = False,
        process_group: dist.ProcessGroup | None = None,
        verify_before_commit: bool = False,
        on_save_start: Callback | None = None,
        on_save_end: Callback | None = None,
        on_load_end: Callback | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        writer_settings: WriterSettings | None = None,
        reader_settings: ReaderSettings | None = None,
        trust_checkpoint: bool = False,
        compression: str | None = None,
        compression_level: int | None = None,
        local_dirname: str | os.PathLike[str] | None = None,
        local_storage_options: dict[str, Any] | None = None,
        keep_last_n_local: int = 1,
        drain: str = DRAIN_EVERY,
        on_drain_end: Callback | None = None,
        resume: str = "auto",
    ) -> None:
        if resume not in RESUME_MODES:
            raise ValueError(f"resume={resume!r} is not supported; choose one of {list(RESUME_MODES)}")
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode={async_mode!r} is not supported; choose one of {list(ASYNC_MODES)}")
        if keep_last_n is not None and (isinstance(keep_last_n, bool) or not isinstance(keep_last_n, int) or keep_last_n < 1):
            raise ValueError(f"keep_last_n must be None (keep all) or an int >= 1, got {keep_last_n!r}")
        if isinstance(keep_last_n_local, bool) or not isinstance(keep_last_n_local, int) or keep_last_n_local < 1:
            raise ValueError(f"keep_last_n_local must be an int >= 1, got {keep_last_n_local!r}")
        if drain not in DRAIN_POLICIES:
            raise ValueError(f"drain={drain!r} is not supported; choose one of {list(DRAIN_POLICIES)}")
        if isinstance(keys_not_to_resume, str):
            raise TypeError(f"keys_not_to_resume must be a list of keys, got the string {keys_not_to_resume!r}")
        if load_training_state and only_load_scheduler_state:
            raise ValueError(
                f"Checkpointer({redact_url(os.fspath(save_dirname))!r}): load_training_state=True loads every key from "
                "load_path, the scheduler included, and only_load_scheduler_state=True only the model and "
                "the scheduler; pass one of them"
            )
        self._root = resolve(save_dirname, storage_options, retry=retry)
        self._storage_options = dict(storage_options or {})
        load_options = dict((storage_options if load_storage_options is None else load_storage_options) or {})
        self._load_root = resolve(load_path, load_options, retry=retry) if load_path is not None else None
        self._async_mode = async_mode
        self._retry = retry
        self._reader_settings = reader_settings or ReaderSettings()
        self._trust_checkpoint = trust_checkpoint
        self._resume_options = ResumeOptions(load_training_state, only_load_scheduler_state, strict_resume)
        self._load_optimizer = load_optimizer
        self._resume = resume
        self._keys_not_to_resume = tuple(layout.check_key(k) for k in keys_not_to_resume)
        self._collectives = Collectives(process_group)
        self._callbacks = {
            "save_start": on_save_start, "save_end": on_save_end, "load_end": on_load_end, "drain_end": on_drain_end,
        }  # fmt: skip
        self._tiers: TwoTiers | None = None
        # Where save() commits: save_dirname, or this rank's local tier (whose retention TwoTiers
        # applies), over the ranks that tier spans.
        self._save_root = self._root
        save_collectives = self._collectives
        if local_dirname is not None:
            self._tiers = TwoTiers(
                resolve(local_dirname, local_storage_options, retry=retry), self._root, self._collectives,
                keep_last_n_local=keep_last_n_local, keep_last_n=keep_last_n, drain=drain,
                on_drain_end=lambda event: report(event, self._callbacks["drain_end"]),
            )  # fmt: skip
            self._save_root, save_collectives = self._tiers.local, self._tiers.save_collectives
            _EXIT_HOOK.register(self)  # a drain in flight at exit is waited for
        self._save_settings = SaveSettings(
            self._save_root.secret_url,  # the background process connects by itself: keep the password
            self._storage_options if local_dirname is None else dict(local_storage_options or {}),
            keep_last_n=keep_last_n if local_dirname is None else None,
            overwrite=overwrite,
            verify_before_commit=verify_before_commit,
            retry=retry,
            writer=(writer_settings or WriterSettings()).with_compression(compression, compression_level),
        )
        self._pending_end: tuple[int, tuple[str, ...], int, float] | None = None  # async save in flight
        self._save_collectives = save_collectives
        self._pipeline = SavePipeline(self._save_settings, save_collectives, purge_in_background=True)
        self._closed = False
        self._stager: Stager | None = None
        self._background: BackgroundSaver | ThreadSaver | None = None
        if async_mode == ASYNC_PINNED:
            # Start the background process now (a collective, like construction itself), so the
            # first save() does not pay for spawning it.
            self._background_saver()

    @property
    def url(self) -> str:
        """``save_dirname``, normalized (local paths made absolute)."""
        return self._root.url

    # -- saving -------------------------------------------------------------------------------

    def save(self, iteration: int, **state: Any) -> None:
        """Save every keyword as ``{save_dirname}/iter_{iteration:09d}/{key}/`` and commit it.

        Returns once the iteration is committed and the pointer names it (unless a newer one
        was already named; the pointer never moves backwards). With ``local_dirname``, that is
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
        if self._async_mode == ASYNC_DISABLED:
            state_dicts = self._stage(state)
            nbytes = tensor_nbytes(state_dicts)
            self._report("save_start", iteration, tuple(state_dicts), nbytes)
            self._pipeline.run(iteration, state_dicts, self._save_token())
            self._report("save_end", iteration, tuple(state_dicts), nbytes, time.perf_counter() - start)
            if self._tiers is not None:
                self._tiers.committed_locally(iteration)
            return
        # Asynchronous: the previous save must be done before its buffers are overwritten.
        background = self._background_saver()
        self._wait_local()
        state_dicts = self._stage(state)
        nbytes = tensor_nbytes(state_dicts)
        self._report("save_start", iteration, tuple(state_dicts), nbytes)
        if self._stager is None:
            self._stager = Stager()
        staged = {k: self._stager.stage(v) for k, v in state_dicts.items()}
        token = self._save_token()
        self._surviving(lambda: background.submit(iteration, staged, token))
        self._pending_end = (iteration, tuple(staged), nbytes, start)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the asynchronous save in flight (if any) is committed; raise its error.

        Also wait until the files of iterations retention let go of are deleted; with
        ``local_dirname``, until the drain to ``save_dirname`` is done.

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
        background = self._background
        if background is not None:
            self._surviving(lambda: background.wait(timeout))
        pending, self._pending_end = self._pending_end, None
        if pending is not None:
            iteration, keys, nbytes, start = pending
            self._report("save_end", iteration, keys, nbytes, time.perf_counter() - start)
            if self._tiers is not None:
                self._tiers.committed_locally(iteration)

    def _save_token(self) -> str | None:
        """The token of the next save when this rank saves alone (per node): one for every rank,
        from rank 0 (a collective), so a load tells the ranks' copies of one save from copies
        of the same iteration another run left on some node. ``None``: the pipeline draws it."""
        if self._tiers is None or not self._tiers.per_node:
            return None
        return self._collectives.run_on_rank0(lambda: uuid.uuid4().hex)

    def _report(self, kind: str, iteration: int, keys: tuple[str, ...], nbytes: int, seconds: float = 0.0) -> None:
        url = self._save_root.url_of(layout.iteration_path(self._save_root, iteration))
        tier = None if self._tiers is None else LOCAL
        report(CheckpointEvent(kind, iteration, url, keys, nbytes, seconds, tier=tier), self._callbacks[kind])

    def _surviving(self, call: Callable[[], None]) -> None:
        """Run ``call``; if the background process died, forget it so the next save starts another."""
        try:
            call()
        except BackgroundSaveError:
            dead, self._background = self._background, None
            if dead is not None:
                dead.close()
            raise

    def _background_saver(self) -> BackgroundSaver | ThreadSaver:
        if self._background is None:
            if not self._save_root.backend.shared_across_processes:
                # Another process cannot see this process's memory:// store.
                if self._collectives.distributed:
                    raise InvalidURLError(
                        f"async_mode={self._async_mode!r} with several ranks cannot save to {self._save_root.url}: "
                        "memory:// lives in one process; use a local path or an object store"
                    )
                self._background = ThreadSaver(self._pipeline.run)
            else:
                self._background = BackgroundSaver(self._save_settings, self._save_collectives)
            _EXIT_HOOK.register(self)
        return self._background

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
        key given that it saved; 2) else ``load_path`` (``model`` only, also ``scheduler`` with
        ``only_load_scheduler_state``, or every key with ``load_training_state``); 3) else
        nothing: a fresh run, iteration 0, logged as a warning if ``save_dirname`` holds
        anything. The rules in full: :mod:`.resume`.

        Args:
            iteration: resume this committed iteration of ``save_dirname`` instead of the
                latest (``dcp-fsspec ls URL`` lists them), e.g. after the latest was damaged.
            **state: key → the live object to restore into, as for :meth:`save`.

        Returns:
            The iteration resumed (0 for a fresh run or for initial weights from ``load_path``).

        Raises:
            ValueError: ``keys_not_to_resume`` names a key not given here.
            CheckpointNotFoundError: the pointer (or ``iteration``) names a missing or uncommitted
                folder, or (with ``strict_resume``) the checkpoint lacks a key given here.
            CorruptCheckpointError: the pointer does not hold an iteration folder name.
            CheckpointMismatchError: a key's tensors do not fit the live objects.
            CorruptCheckpointError: a file of the checkpoint is damaged; the message names the
                previous committed iteration to load instead.
        """
        self._check_open("load")
        if iteration is not None:
            layout.format_iteration(iteration)
        self._wait_local()  # an asynchronous save in flight lands first
        for key in state:
            layout.check_key(key)
        unknown = sorted(set(self._keys_not_to_resume) - set(state))
        if unknown:
            raise ValueError(
                f"keys_not_to_resume names {unknown}, which load() was not given (given: {sorted(state)}) "
                f"for {self.url}; fix the key names"
            )
        wanted = [
            k for k, v in state.items()
            if k not in self._keys_not_to_resume
            and (self._load_optimizer or (k != OPTIMIZER_KEY and not state_mod.is_optimizer(v)))
        ]
        options = self._resume_options
        if self._tiers is not None:
            resumed = self._load_from_local_tier(iteration, wanted, state)
            if resumed is not None:
                return resumed

        def plan_on_rank0() -> resume.ResumePlan | None:
            facts = resume.gather(
                self._root, self._load_root, wanted, options, self._reader_settings,
                iteration=iteration, trust_checkpoint=self._trust_checkpoint,
            )  # fmt: skip
            plan = resume.plan_resume(facts, wanted, options)
            if plan is None:
                self._start_fresh(facts.leftovers)
            return plan if plan is None or not self._collectives.distributed else plan.without_metadata()

        plan = self._collectives.run_on_rank0(plan_on_rank0)
        if plan is None:
            return 0
        source = self._load_root if plan.from_load_path else self._root
        assert source is not None  # a plan from load_path was made from it
        tier = None if self._tiers is None or plan.from_load_path else DURABLE
        resumed = self._load_plan(plan, source, state, tier=tier)
        if tier == DURABLE:
            assert self._tiers is not None
            self._tiers.forget_newer_than(resumed)
        return resumed

    def _start_fresh(self, leftovers: str | None) -> None:
        """Say that nothing was resumed, at WARNING; raise instead with ``resume="required"``."""
        if leftovers:
            found = f"it holds {leftovers}"
            advice = "if you meant another save_dirname, fix it; to start over here, empty the folder"
        else:
            found = "it is empty or does not exist, and there is no load_path"
            advice = "if you meant to resume, check save_dirname for a typo"
        if self._resume == "required":
            raise CheckpointNotFoundError(
                f"nothing to resume under {self.url}: {found}; {advice} (resume='required' refuses to train from scratch)"
            )
        logger.warning(
            "nothing to resume under %s: %s; training from scratch at iteration 0. %s "
            "(resume='required' makes this an error)", self.url, found, advice[0].upper() + advice[1:],
        )  # fmt: skip

    def _load_plan(
        self, plan: resume.ResumePlan, source: Location, state: dict[str, Any], *, tier: str | None,
        alone: bool = False,
    ) -> int:  # fmt: skip
        """Restore ``plan``'s keys into ``state``; return its iteration.

        ``source``: where the plan was found (``save_dirname``, ``load_path`` or the local tier):
        every key's reader uses its filesystem rather than building one from the key's URL.

        ``alone``: each rank reads a checkpoint of its own (a per-node local tier): DCP runs
        without collectives, every rank checks that its copy covers what it loads, and the
        ranks still agree on every failure before anything is restored.
        """
        if self._collectives.rank == 0:
            for level, note in plan.notes:
                logger.log(level, note)
        # The model first: optimizers are restored by the names of its parameters.
        reader_options = dict(
            fs=source.fs, retry=self._retry,
            trust_checkpoint=self._trust_checkpoint, **self._reader_settings.as_kwargs(),
        )  # fmt: skip
        ordered = [(k, plan.keys[k]) for k in sorted(plan.keys, key=lambda k: k != MODEL_KEY)]
        start, nbytes = time.perf_counter(), 0
        applied: list[str] = []
        try:
            # Every key is checked on every rank before the first is applied (preflight.py).
            checked = preflight.check_keys(
                ordered, state, model=state.get(MODEL_KEY), reader_options=reader_options,
                new_planner=self._new_planner, collectives=self._collectives, alone=alone,
            )  # fmt: skip
            side_by_side = self._keys_at_once(checked)
            if side_by_side:
                self._read_keys_at_once(ordered, checked)
            for key, where in ordered:
                try:
                    if not side_by_side:
                        self._read_key(key, where, checked[key], alone=alone)
                    state_mod.restore(key, state[key], checked[key].state_dict, model=state.get(MODEL_KEY),
                                      strict=self._resume_options.strict_resume)  # fmt: skip
                except CorruptCheckpointError as e:
                    raise preflight.partly_loaded(e, key, applied) from e
                applied.append(key)
                nbytes += tensor_nbytes(checked[key].state_dict)
        except CorruptCheckpointError as e:
            if plan.from_load_path or tier == LOCAL:
                raise
            raise self._with_fallback_advice(e, plan.iteration) from e
        event = CheckpointEvent("load_end", plan.iteration, plan.source, tuple(plan.keys), nbytes,
                                time.perf_counter() - start, tier=tier)
        report(event, self._callbacks["load_end"])
        if self._collectives.rank == 0:
            logger.info("resumed %s from %s%s", sorted(plan.keys), plan.source, "" if tier is None else f" ({tier} tier)")
        return plan.iteration

    def _load_from_local_tier(self, iteration: int | None, wanted: list[str], state: dict[str, Any]) -> int | None:
        """Resume from the local tier if every rank has the iteration to resume there; else None.

        A damaged local copy (a checksum error on any rank) is logged, and None sends ``load``
        to the durable tier.
        """
        assert self._tiers is not None
        choice, durable_latest = self._tiers.choose(iteration, trust_checkpoint=self._trust_checkpoint)
        if choice is None or choice[1] != LOCAL:
            return None
        local, options = self._save_root, self._resume_options
        plan: resume.ResumePlan | None = None
        error: Exception | None = None
        try:  # each rank its own local tier
            facts = resume.gather(local, None, wanted, options, self._reader_settings, iteration=choice[0],
                                  trust_checkpoint=self._trust_checkpoint)  # fmt: skip
            plan = resume.plan_resume(facts, wanted, options)
        except Exception as e:  # re-raised below, on every rank
            error = e
        self._collectives.raise_if_any_failed(error)
        assert plan is not None
        per_node = self._tiers.per_node
        try:
            resumed = self._load_plan(plan, local, state, tier=LOCAL, alone=per_node)
        except CorruptCheckpointError as e:
            if self._collectives.rank == 0:
                logger.warning("the local copy %s is damaged (%s); resuming from the durable tier %s instead",
                               plan.source, e, self.url)  # fmt: skip
            return None
        except CheckpointMismatchError as e:
            if not per_node:
                raise  # one copy for all ranks, the same as the durable one: it would not fit either
            # A rank's own copy holds its share as saved; another sharding (world size) needs others'.
            if self._collectives.rank == 0:
                logger.warning("the local copies under %s do not hold what every rank loads (%s); resuming from "
                               "the durable tier %s instead", self._tiers.local.url, e, self.url)  # fmt: skip
            return None
        self._tiers.forget_newer_than(resumed)
        self._tiers.resumed_locally(resumed, durable_latest)
        return resumed

    def _keys_at_once(self, checked: dict[str, preflight.CheckedKey]) -> bool:
        """Whether the keys may be read side by side: as the save writes them (see
        :meth:`.pipeline.SavePipeline._keys_at_once`), on one rank and while the whole state fits
        one reader's window, so that several readers hold no more memory than one would; and
        where a read costs a round trip (on local disk one key's reader has its own threads)."""
        return (
            len(checked) > 1
            and not self._collectives.distributed
            and not all(c.reader.location.answers_locally for c in checked.values())
            and sum(tensor_nbytes(c.state_dict) for c in checked.values()) <= self._reader_settings.window_bytes
        )

    def _read_keys_at_once(self, ordered: list[tuple[str, KeyToLoad]], checked: dict[str, preflight.CheckedKey]) -> None:
        """One rank: read every key's data at once (keys are independent DCP checkpoints, so a
        small load costs the round trips of one key); they are restored afterwards, in order.

        Raises:
            CorruptCheckpointError: a key's data is damaged (the first in order, named as partly
                loaded); the keys before it are named as restored (their tensors were read in
                place), and those after it may be partly loaded too.
        """
        def read(key: str, where: KeyToLoad) -> CorruptCheckpointError | None:
            try:
                self._read_key(key, where, checked[key], alone=False)
            except CorruptCheckpointError as e:
                return e
            return None

        errors = at_once([partial(read, key, where) for key, where in ordered])
        for i, ((key, _), error) in enumerate(zip(ordered, errors, strict=True)):
            if error is not None:
                raise preflight.partly_loaded(error, key, [k for k, _ in ordered[:i]]) from error

    def _read_key(self, key: str, where: KeyToLoad, checked: preflight.CheckedKey, *, alone: bool) -> None:
        """Read one checked key's tensors into its state dict (``alone``: see :meth:`_load_plan`)."""
        error: Exception | None = None
        try:
            dcp.load(
                checked.target,
                storage_reader=checked.reader,
                planner=checked.planner,
                process_group=None if alone else self._collectives.group,
                no_dist=alone or not self._collectives.distributed,
            )
        except CheckpointException as e:
            action = f"loading key {key!r} from {where.url}"
            error = unwrap_dcp(e, action, mismatch=True, metadata_failure=checked.reader.metadata_failure)
            error.__cause__ = e  # as `raise … from e` would
        if alone:
            # Without DCP's collectives one rank's damaged copy fails that rank alone: agree
            # before restoring, whose collectives (FSDP) every rank must enter or none.
            self._collectives.raise_if_any_failed(error)
        elif error is not None:
            raise error

    def _new_planner(self) -> preflight.CheckedPlanner:
        return preflight.CheckedPlanner(allow_partial_load=not self._resume_options.strict_resume, trust_checkpoint=self._trust_checkpoint)

    def _with_fallback_advice(self, error: CorruptCheckpointError, iteration: int) -> CorruptCheckpointError:
        """``error``, saying which older committed iteration ``load(iteration=…)`` can resume instead."""
        older = [i for i in commit.committed_iterations(self._root) if i < iteration]
        advice = (
            f"; to resume from the previous committed iteration instead, call load(iteration={older[-1]}, ...)"
            if older
            else f"; no older committed iteration is under {self.url} to fall back to"
        )
        return type(error)(f"{error}{advice}")

    # -- inspection and lifetime --------------------------------------------------------------

    def latest_checkpoint(self) -> str | None:
        """The folder name the pointer holds (``"iter_000000010"``), or None before any save.

        Any rank may call it alone. It does not check that the folder is committed.

        Raises:
            CorruptCheckpointError: the pointer does not hold an iteration folder name.
        """
        latest = commit.read_pointer(self._root)
        return None if latest is None else layout.format_iteration(latest)

    def committed_iterations(self) -> list[int]:
        """Every committed iteration under ``save_dirname``, ascending. Any rank may call it."""
        return commit.committed_iterations(self._root)

    def finalize(self) -> None:
        """Finish pending work and release resources; later saves and loads are errors.

        Safe to call twice. The ``with`` statement calls it on exit. With ``local_dirname`` it
        waits for the drain, and raises :class:`~dcp_fsspec.errors.DrainError` if it failed.
        """
        if not self._closed:
            self._closed = True
            try:
                if self._background is not None or self._tiers is not None:
                    try:
                        self.wait()
                    finally:
                        if self._background is not None:
                            self._background.close()
            finally:
                self._pipeline.wait_for_purge()
                self._background = None
                if self._stager is not None:
                    self._stager.close()
                self._collectives.close()

    def _finish_at_exit(self, timeout: float) -> None:
        """At interpreter exit: let the save in flight commit (within ``timeout``), then finalize.

        A script that ends without :meth:`finalize` or a ``with`` block would otherwise lose its
        last asynchronous save; it is waited for here, and named in the log either way.
        """
        if self._closed:
            return
        if self._pending_end is not None:
            iteration = self._pending_end[0]
            logger.warning(
                "the interpreter is exiting while iteration %d is being saved to %s; waiting up to %.0f s "
                "for it to commit (call finalize() or use a `with` block to wait where you choose)",
                iteration, self.url, timeout,
            )  # fmt: skip
            try:
                self.wait(timeout)
            except TimeoutError:
                logger.error(
                    "iteration %d was NOT committed to %s: its save did not finish within %.0f s of the "
                    "interpreter exiting; the pointer still names the previous checkpoint",
                    iteration, self.url, timeout,
                )  # fmt: skip
                return
            except Exception as e:  # noqa: BLE001 - the interpreter is exiting; the log is all that is left
                logger.error("iteration %d was NOT committed to %s: %s", iteration, self.url, e)
        try:
            self.finalize()
        except Exception as e:  # noqa: BLE001 - as above
            logger.warning("could not finalize the Checkpointer for %s at exit: %s", self.url, e)

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or getattr(self, "_background", None) is None:
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


class _ExitHook:
    """Checkpointers with a background saver, finished when the interpreter exits.

    Registered with ``atexit`` when the first background saver starts, so it runs before
    ``multiprocessing``'s own exit handler (handlers run last-registered first), which would
    terminate the background process mid-save. Holds the checkpointers weakly.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._open: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
        self._registered = False

    def register(self, checkpointer: Checkpointer) -> None:
        self._open.add(checkpointer)
        if not self._registered:
            atexit.register(self.run)
            self._registered = True

    def run(self) -> None:
        for checkpointer in list(self._open):
            checkpointer._finish_at_exit(self.timeout)


# How long the interpreter's exit waits for an asynchronous save in flight.
EXIT_WAIT_SECONDS = 600.0
_EXIT_HOOK = _ExitHook(EXIT_WAIT_SECONDS)

