"""The Checkpointer: save training state to any fsspec URL each k steps, and resume from it.

It composes the pieces: ``state`` turns each keyword into a DCP state dict; every key is written
by our ``FsspecStorageWriter`` into ``{save_dirname}/iter_…/{key}/``; ``commit`` marks the
iteration committed and moves the pointer; ``retention`` deletes old iterations. A save is four
small steps (stage, write every key, commit, retention) so that an asynchronous mode can run
the middle two in the background without changing them.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import (
    CorruptCheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    DcpFsspecError,
    InvalidURLError,
    StorageError,
)
from ..storage.collector import collector_paused
from ..storage.reader import FsspecStorageReader
from ..storage.urls import Location, resolve
from ..storage.writer import FsspecStorageWriter
from . import commit, layout, retention
from . import state as state_mod
from ._collectives import Collectives
from .events import Callback, CheckpointEvent, report, tensor_nbytes
from .background import BackgroundSaveError, BackgroundSaver, SaverSettings, ThreadSaver
from .staging import Stager

logger = logging.getLogger(__name__)

ASYNC_DISABLED = "disabled"
ASYNC_PINNED = "async_with_pinned_mem"
ASYNC_MODES = (ASYNC_DISABLED, ASYNC_PINNED)
OPTIMIZER_KEY = "optim"
MODEL_KEY = "model"


@dataclass(frozen=True)
class _ResumePlan:
    """What :meth:`Checkpointer.load` reads, decided on rank 0 and broadcast (plain strings)."""

    source: str  # the iteration folder's URL, for messages
    iteration: int
    key_urls: dict[str, str]  # key → DCP checkpoint URL
    from_load_path: bool  # read with load_storage_options rather than storage_options


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
            save; ``None`` keeps everything.
        load_path: initial weights for a run with nothing under ``save_dirname`` yet: an
            iteration folder (``…/iter_000000100``), a ``save_dirname`` with a pointer, or a single
            DCP checkpoint of the model.
        load_storage_options: fsspec options for ``load_path``; default ``storage_options``.
        load_training_state: with ``load_path``, load every key given to :meth:`load`, not only
            ``model``, and return the iteration in the folder's name.
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

    Raises:
        ValueError: an unknown ``async_mode``, or ``keep_last_n`` below 1.
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
        strict_resume: bool = True,
        load_optimizer: bool = True,
        keys_not_to_resume: tuple[str, ...] | list[str] = (),
        overwrite: bool = False,
        process_group: dist.ProcessGroup | None = None,
        verify_before_commit: bool = False,
        on_save_start: Callback | None = None,
        on_save_end: Callback | None = None,
        on_load_end: Callback | None = None,
    ) -> None:
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode={async_mode!r} is not supported; choose one of {list(ASYNC_MODES)}")
        if keep_last_n is not None and (isinstance(keep_last_n, bool) or not isinstance(keep_last_n, int) or keep_last_n < 1):
            raise ValueError(f"keep_last_n must be None (keep all) or an int >= 1, got {keep_last_n!r}")
        if isinstance(keys_not_to_resume, str):
            raise TypeError(f"keys_not_to_resume must be a list of keys, got the string {keys_not_to_resume!r}")
        self._root = resolve(save_dirname, storage_options)
        self._storage_options = dict(storage_options or {})
        self._load_storage_options = dict((storage_options if load_storage_options is None else load_storage_options) or {})
        self._load_root = resolve(load_path, self._load_storage_options) if load_path is not None else None
        self._async_mode = async_mode
        self._keep_last_n = keep_last_n
        self._load_training_state = load_training_state
        self._strict_resume = strict_resume
        self._load_optimizer = load_optimizer
        self._keys_not_to_resume = tuple(layout.check_key(k) for k in keys_not_to_resume)
        self._overwrite = overwrite
        self._verify_before_commit = verify_before_commit
        self._callbacks = {"save_start": on_save_start, "save_end": on_save_end, "load_end": on_load_end}
        self._pending_end: tuple[int, tuple[str, ...], int, float] | None = None  # async save in flight
        self._collectives = Collectives(process_group)
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
        was already named; the pointer never moves backwards).

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
            self._save_staged(iteration, state_dicts)
            self._report("save_end", iteration, tuple(state_dicts), nbytes, time.perf_counter() - start)
            return
        # Asynchronous: the previous save must be done before its buffers are overwritten.
        background = self._background_saver()
        self.wait()
        state_dicts = self._stage(state)
        nbytes = tensor_nbytes(state_dicts)
        self._report("save_start", iteration, tuple(state_dicts), nbytes)
        if self._stager is None:
            self._stager = Stager()
        staged = {k: self._stager.stage(v) for k, v in state_dicts.items()}
        self._surviving(lambda: background.submit(iteration, staged))
        self._pending_end = (iteration, tuple(staged), nbytes, start)

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is committed; raise its error."""
        pending, self._pending_end = self._pending_end, None
        if self._background is not None:
            self._surviving(self._background.wait)
        if pending is not None:
            iteration, keys, nbytes, start = pending
            self._report("save_end", iteration, keys, nbytes, time.perf_counter() - start)

    def _report(self, kind: str, iteration: int, keys: tuple[str, ...], nbytes: int, seconds: float = 0.0) -> None:
        url = self._root.url_of(layout.iteration_path(self._root, iteration))
        report(CheckpointEvent(kind, iteration, url, keys, nbytes, seconds), self._callbacks[kind])

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
            if not self._root.backend.shared_across_processes:
                # Another process cannot see this process's memory:// store.
                if self._collectives.distributed:
                    raise InvalidURLError(
                        f"async_mode={self._async_mode!r} with several ranks cannot save to {self.url}: "
                        "memory:// lives in one process; use a local path or an object store"
                    )
                self._background = ThreadSaver(self)
            else:
                settings = SaverSettings(
                    self.url, self._storage_options, self._keep_last_n, self._overwrite, self._verify_before_commit
                )
                self._background = BackgroundSaver(settings, self._collectives)
        return self._background

    @collector_paused()
    def _save_staged(self, iteration: int, staged: dict[str, dict[str, Any]]) -> None:
        """The save pipeline after staging: prepare the folder, write every key, commit, retention."""
        keys = tuple(staged)
        self._collectives.run_on_rank0(lambda: self._prepare_folder(iteration))
        for key in keys:
            self._write_key(iteration, key, staged[key])
        self._commit(iteration, keys)
        self._apply_retention(protected=(iteration,))

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

    def _prepare_folder(self, iteration: int) -> None:
        """Rank 0: refuse to replace a committed iteration; clear leftovers of an uncommitted one."""
        root = self._root
        folder = root.url_of(layout.iteration_path(root, iteration))
        latest = commit.read_pointer(root)
        if latest is not None and latest > iteration and not self._overwrite:
            raise CheckpointExistsError(
                f"cannot save {folder}: {commit.pointer_url(root)} already names the newer "
                f"{layout.format_iteration(latest)} and never moves backwards; save a later iteration, use "
                "a new save_dirname, or pass overwrite=True to write it anyway (the pointer stays)"
            )
        record, reason = commit.inspect_iteration(root, iteration)
        # Committed but newer than the pointer: its save died between the commit record and the
        # pointer, so nothing names it; the resumed run replaces it like any leftover.
        unpublished = record is not None and (latest is None or latest < iteration)
        if record is not None and not self._overwrite and not unpublished:
            raise CheckpointExistsError(
                f"{folder} is already a committed checkpoint; save a different iteration, or pass "
                "overwrite=True to replace it"
            )
        if unpublished:
            logger.info("replacing %s, committed by a save that died before moving the pointer", folder)
        elif record is not None:
            logger.warning("overwriting the committed checkpoint %s", folder)
        elif reason != "does not exist":
            logger.info("clearing %s, left by a save that never committed (%s)", folder, reason)
        if record is not None or reason != "does not exist":
            commit.discard_iteration(root, iteration)

    def _write_key(self, iteration: int, key: str, state_dict: dict[str, Any]) -> None:
        url = self._root.url_of(layout.key_path(self._root, iteration, key))
        writer = FsspecStorageWriter(url, storage_options=self._storage_options)
        try:
            dcp.save(
                state_dict,
                storage_writer=writer,
                process_group=self._collectives.group,
                no_dist=not self._collectives.distributed,
            )
        except CheckpointException as e:
            raise _unwrap(e, f"saving key {key!r} to {url}", mismatch=False) from e

    def _commit(self, iteration: int, keys: tuple[str, ...]) -> None:
        """Every rank finished every key → rank 0 writes the commit record, then the pointer."""
        self._collectives.raise_if_any_failed(None)

        def on_rank0() -> None:
            if self._verify_before_commit:
                self._verify_keys(iteration, keys)
            commit.publish(self._root, iteration, keys, self._collectives.world_size, behind_pointer=self._overwrite)
            logger.info("committed %s", self._root.url_of(layout.iteration_path(self._root, iteration)))

        self._collectives.run_on_rank0(on_rank0)

    def _verify_keys(self, iteration: int, keys: tuple[str, ...]) -> None:
        """Rank 0, before the commit: re-read every key's files and check every CRC-32."""
        from ..tools.verify import verify  # the integrity checker lives with the tools

        for key in keys:
            url = self._root.url_of(layout.key_path(self._root, iteration, key))
            report = verify(url, self._storage_options)
            if not report.ok:
                raise CorruptCheckpointError(
                    f"not committing {self._root.url_of(layout.iteration_path(self._root, iteration))}: "
                    f"verifying key {key!r} found {len(report.problems)} problem(s), first: "
                    f"{report.problems[0]}; the pointer stays where it was — save again"
                )

    def _apply_retention(self, protected: tuple[int, ...]) -> None:
        if self._keep_last_n is not None and self._collectives.rank == 0:
            retention.apply_retention(self._root, self._keep_last_n, protected=protected)

    # -- loading ------------------------------------------------------------------------------

    @collector_paused()
    def load(self, **state: Any) -> int:
        """Restore every keyword in place and return the iteration to continue from.

        In order: 1) the iteration ``latest_checkpoint.txt`` names under ``save_dirname``, every
        key given that it saved; 2) else ``load_path`` (``model`` only, or every key with
        ``load_training_state``); 3) else nothing: a fresh run, iteration 0.

        Args:
            **state: key → the live object to restore into, as for :meth:`save`.

        Returns:
            The iteration resumed (0 for a fresh run or for initial weights from ``load_path``).

        Raises:
            ValueError: ``keys_not_to_resume`` names a key not given here.
            CheckpointNotFoundError: the pointer names a missing or uncommitted folder, or (with
                ``strict_resume``) the checkpoint lacks a key given here.
            CorruptCheckpointError: the pointer does not hold an iteration folder name.
            CheckpointMismatchError: a key's tensors do not fit the live objects.
        """
        self._check_open("load")
        self.wait()  # an asynchronous save in flight lands first
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
        plan = self._collectives.run_on_rank0(lambda: self._plan_resume(wanted))
        if plan is None:
            if self._collectives.rank == 0:
                logger.info("no checkpoint under %s and no load_path: training from scratch", self.url)
            return 0
        # The model first: optimizers are restored by the names of its parameters.
        options = self._load_storage_options if plan.from_load_path else self._storage_options
        start, nbytes = time.perf_counter(), 0
        for key in sorted(plan.key_urls, key=lambda k: k != MODEL_KEY):
            nbytes += self._load_key(key, plan.key_urls[key], options, state[key], model=state.get(MODEL_KEY))
        event = CheckpointEvent("load_end", plan.iteration, plan.source, tuple(plan.key_urls), nbytes,
                                time.perf_counter() - start)
        report(event, self._callbacks["load_end"])
        if self._collectives.rank == 0:
            logger.info("resumed %s from %s", sorted(plan.key_urls), plan.source)
        return plan.iteration

    def _plan_resume(self, wanted: list[str]) -> _ResumePlan | None:
        """Rank 0: which folder and keys :meth:`load` reads (the resume rules), or None."""
        root = self._root
        latest = commit.read_pointer(root)
        if latest is not None:
            record = commit.require_committed(root, latest, named_by=commit.pointer_url(root))
            return self._select_keys(root, latest, latest, wanted, record.keys, from_load_path=False)
        if self._load_root is None:
            return None
        return self._plan_from_load_path(self._load_root, wanted)

    def _plan_from_load_path(self, source: Location, wanted: list[str]) -> _ResumePlan:
        keys = wanted if self._load_training_state else [k for k in wanted if k == MODEL_KEY]
        if commit.exists(source, source.join(commit.METADATA_NAME)):
            # A single DCP checkpoint: taken to be the model's weights, and nothing else.
            self._report_missing(
                [k for k in keys if k != MODEL_KEY],
                f"load_path {source.url}, a single DCP checkpoint taken as the model,",
                (MODEL_KEY,),
                fix="set load_training_state=False, or point load_path at an iteration folder",
            )
            return _ResumePlan(source.url, 0, {MODEL_KEY: source.url} if MODEL_KEY in keys else {}, True)
        pointed = commit.read_pointer(source)
        if pointed is not None:
            record = commit.require_committed(source, pointed, named_by=commit.pointer_url(source))
            iteration = pointed if self._load_training_state else 0
            return self._select_keys(source, pointed, iteration, keys, record.keys, from_load_path=True)
        # An iteration folder: its keys are the subfolders with .metadata.
        saved = tuple(k for k in keys if commit.exists(source, posixpath.join(source.join(k), commit.METADATA_NAME)))
        if not saved:
            raise CheckpointNotFoundError(
                f"load_path {source.url} holds no DCP checkpoint of {keys} (no {commit.METADATA_NAME} "
                "there nor in a key subfolder, and no latest_checkpoint.txt); check the URL"
            )
        iteration = 0
        if self._load_training_state:
            parsed = layout.parse_iteration(source.path)
            if parsed is None:
                logger.warning("load_path %s is not named iter_…; resuming at iteration 0", source.url)
            iteration = parsed or 0
        urls = {k: source.url_of(source.join(k)) for k in saved}
        missing = [k for k in keys if k not in saved]
        self._report_missing(missing, source.url, saved)
        return _ResumePlan(source.url, iteration, urls, True)

    def _select_keys(
        self,
        root: Location,
        folder_iteration: int,
        iteration: int,
        wanted: list[str],
        saved: tuple[str, ...],
        *,
        from_load_path: bool,
    ) -> _ResumePlan:
        folder = root.url_of(layout.iteration_path(root, folder_iteration))
        self._report_missing([k for k in wanted if k not in saved], folder, saved)
        urls = {k: root.url_of(layout.key_path(root, folder_iteration, k)) for k in wanted if k in saved}
        return _ResumePlan(folder, iteration, urls, from_load_path)

    def _report_missing(self, missing: list[str], where: str, saved: tuple[str, ...], *, fix: str = "") -> None:
        """Keys given to load() that the checkpoint lacks: an error if strict, else a log line."""
        if not missing:
            return
        if self._strict_resume:
            raise CheckpointNotFoundError(
                f"checkpoint {where} has no key(s) {missing} (it holds {sorted(saved)}); "
                f"{fix or 'pass strict_resume=False to skip them, or list them in keys_not_to_resume'}"
            )
        logger.info("checkpoint %s has no key(s) %s; they keep their current values", where, missing)

    def _load_key(self, key: str, url: str, storage_options: dict[str, Any], value: Any, *, model: Any) -> int:
        """Load one key in place; return the tensor bytes this rank read."""
        state_dict = state_mod.state_dict_for(key, value, model=model)
        reader = FsspecStorageReader(url, storage_options=storage_options)
        try:
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=DefaultLoadPlanner(allow_partial_load=not self._strict_resume),
                process_group=self._collectives.group,
                no_dist=not self._collectives.distributed,
            )
        except CheckpointException as e:
            raise _unwrap(e, f"loading key {key!r} from {url}", mismatch=True) from e
        state_mod.restore(key, value, state_dict, model=model, strict=self._strict_resume)
        return tensor_nbytes(state_dict)

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

        Safe to call twice. The ``with`` statement calls it on exit.
        """
        if not self._closed:
            self._closed = True
            try:
                if self._background is not None:
                    try:
                        self.wait()
                    finally:
                        if self._background is not None:
                            self._background.close()
            finally:
                self._background = None
                if self._stager is not None:
                    self._stager.close()
                self._collectives.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finalize()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {what}: the Checkpointer for {self.url} was finalized")


def _unwrap(error: CheckpointException, action: str, *, mismatch: bool) -> Exception:
    """One of our exceptions for DCP's per-rank ``CheckpointException``.

    Our storage layer's own errors pass through unchanged; backend ``OSError``s become
    ``StorageError``; anything else on load means the checkpoint does not fit the live objects.
    """
    ranks = sorted(error.failures)
    first, _traceback = error.failures[ranks[0]]
    if isinstance(first, DcpFsspecError):
        return first
    if isinstance(first, OSError):
        cls: type[DcpFsspecError] = StorageError
    else:
        cls = CheckpointMismatchError if mismatch else DcpFsspecError
    return cls(f"{action} failed on rank(s) {ranks}: {type(first).__name__}: {first}")
