"""The load pipeline: from live objects to restored state, the counterpart of the save pipeline.

One load, read top to bottom in :meth:`LoadPipeline.run`:

1. The keys to restore: every key given, less ``keys_not_to_resume`` and skipped optimizers.
2. The tier: with a local tier, the newest iteration every rank holds there wins
   (:meth:`LoadPipeline._from_local_tier`); a damaged or unfitting local copy falls back to
   the durable tier, logged.
3. The resume decision, on rank 0 (:mod:`~dcp_fsspec.checkpoint.load.resume`): the pointer's iteration, else
   ``load_path``, else a fresh start (logged at WARNING, at INFO where a new run is expected,
   or an error when required).
4. The preflight (:mod:`~dcp_fsspec.checkpoint.load.preflight`): every key is planned and checked on every rank before
   the first is applied.
5. The reads: one key after another, or all at once where that is cheaper.
6. The agreement: a failure on any rank fails every rank, with advice on what to load instead.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsspec.checkpoint import state as state_mod
from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.checkpoint.commit import layout, run_listing
from dcp_fsspec.checkpoint.commit.at_once import at_once
from dcp_fsspec.checkpoint.events import Callback, CheckpointEvent, report, tensor_nbytes
from dcp_fsspec.checkpoint.load import preflight, resume
from dcp_fsspec.checkpoint.load.resume import MODEL_KEY, KeyToLoad
from dcp_fsspec.checkpoint.options import ResumeOptions
from dcp_fsspec.checkpoint.tiers.tiered import DURABLE, LOCAL, TwoTiers
from dcp_fsspec.errors import CheckpointMismatchError, CheckpointNotFoundError, CorruptCheckpointError
from dcp_fsspec.storage.format.metadata_file import read_metadata
from dcp_fsspec.storage.read.reader import FsspecStorageReader
from dcp_fsspec.storage.settings import ReaderSettings
from dcp_fsspec.storage.transport.error_wrapping import unwrap_dcp
from dcp_fsspec.storage.transport.retry import RetryPolicy
from dcp_fsspec.storage.transport.urls import Location

logger = logging.getLogger(__name__)

OPTIMIZER_KEY = "optim"


class LoadPipeline:
    """Restores a Checkpointer's keys in place; built once per Checkpointer.

    Args:
        root: ``save_dirname``.
        load_root: ``load_path``, if any.
        collectives: the ranks that load together.
        options: what to resume and from where.
        reader_settings: the tuning of every reader; its ``trust_checkpoint`` also governs
            the load planner and the resume checks.
        retry: how storage calls are retried.
        tiers: the two tiers, when the Checkpointer has a local tier.
        on_event: receives the ``load_end`` event.
    """

    def __init__(
        self,
        root: Location,
        *,
        load_root: Location | None,
        collectives: Collectives,
        options: ResumeOptions,
        reader_settings: ReaderSettings,
        retry: RetryPolicy | None,
        tiers: TwoTiers | None,
        on_event: Callback | None,
    ) -> None:
        self._root = root
        self._load_root = load_root
        self._collectives = collectives
        self._options = options
        self._reader_settings = reader_settings
        # The ranks reading one copy together cooperate unless told not to (None: on).
        self._settings_together = dataclasses.replace(
            reader_settings, cooperative=reader_settings.cooperative is not False
        )
        # What one rank reads by itself (the resume rules, a local tier) is never cooperative.
        self._settings_alone = dataclasses.replace(reader_settings, cooperative=False)
        self._retry = retry
        self._trust_checkpoint = reader_settings.trust_checkpoint
        self._tiers = tiers
        self._on_event = on_event

    def run(self, iteration: int | None, state: dict[str, Any]) -> int:
        """Restore ``state`` from ``iteration`` (None: the latest); return the iteration resumed.

        Raises: as :meth:`Checkpointer.load <dcp_fsspec.Checkpointer.load>`.
        """
        wanted = self._wanted(state)
        if self._tiers is not None:
            resumed = self._from_local_tier(iteration, wanted, state)
            if resumed is not None:
                return resumed
        plan = self._collectives.run_on_rank0(partial(self._decide, iteration, wanted))
        if plan is None:
            return 0
        source = self._load_root if plan.from_load_path else self._root
        assert source is not None  # a plan from load_path was made from it
        tier = None if self._tiers is None or plan.from_load_path else DURABLE
        resumed = self._restore(plan, source, state, tier=tier)
        if self._tiers is not None and tier == DURABLE:
            self._tiers.forget_newer_than(resumed)
        return resumed

    # -- 1. the keys ------------------------------------------------------------------------------

    def _wanted(self, state: dict[str, Any]) -> list[str]:
        for key in state:
            layout.check_key(key)
        skipped = self._options.keys_not_to_resume
        unknown = sorted(set(skipped) - set(state))
        if unknown:
            raise ValueError(
                f"keys_not_to_resume names {unknown}, which load() was not given (given: {sorted(state)}) "
                f"for {self._root.url}; fix the key names"
            )
        return [
            k
            for k, v in state.items()
            if k not in skipped
            and (self._options.load_optimizer or (k != OPTIMIZER_KEY and not state_mod.is_optimizer(v)))
        ]

    # -- 2. the tier ------------------------------------------------------------------------------

    def _from_local_tier(self, iteration: int | None, wanted: list[str], state: dict[str, Any]) -> int | None:
        """Resume from the local tier if every rank has the iteration to resume there; else None.

        A damaged local copy (a checksum error on any rank) is logged, and None sends the load
        to the durable tier.
        """
        tiers = self._tiers
        assert tiers is not None
        if tiers.replicated:
            return self._from_shares(iteration, wanted, state)
        choice, durable_latest = tiers.choose(iteration, trust_checkpoint=self._trust_checkpoint)
        if choice is None or choice.tier != LOCAL:
            return None
        local = tiers.local
        plan = self._plan_alone(local, wanted, choice.iteration)  # each rank its own local tier
        try:
            resumed = self._restore(plan, local, state, tier=LOCAL, alone=tiers.per_node)
        except CorruptCheckpointError as e:
            self._log_on_rank0(
                "the local copy %s is damaged (%s); resuming from the durable tier %s instead",
                plan.source,
                e,
                self._root.url,
            )
            return None
        except CheckpointMismatchError as e:
            if not tiers.per_node:
                raise  # one copy for all ranks, the same as the durable one: it would not fit either
            # A rank's own copy holds its share as saved; another sharding (world size) needs others'.
            self._log_on_rank0(
                "the local copies under %s do not hold what every rank loads (%s); resuming "
                "from the durable tier %s instead",
                local.url,
                e,
                self._root.url,
            )
            return None
        tiers.forget_newer_than(resumed)
        tiers.resumed_locally(resumed, durable_latest)
        return resumed

    def _plan_alone(self, source: Location, wanted: list[str], iteration: int) -> resume.ResumePlan:
        """This rank's resume plan from ``source``, read by itself; an error is raised on every rank."""
        plan: resume.ResumePlan | None = None
        error: Exception | None = None
        try:
            facts = resume.gather(
                source, None, wanted, self._options, self._settings_alone, iteration=iteration
            )
            plan = resume.plan_resume(facts, wanted, self._options)
        except Exception as e:  # re-raised below, on every rank
            error = e
        self._collectives.raise_if_any_failed(error)
        assert plan is not None
        return plan

    def _from_shares(self, iteration: int | None, wanted: list[str], state: dict[str, Any]) -> int | None:
        """With replicas: each rank reads its share from its own local tier (its own copy, or a
        peer's replica just brought home) or from the durable tier, by itself; None: every rank
        reads the durable tier (logged)."""
        tiers = self._tiers
        assert tiers is not None
        shares = tiers.shares(iteration, trust_checkpoint=self._trust_checkpoint)
        if shares is None:
            return None
        tier = shares.sources[self._collectives.rank].kind
        source = self._root if tier == DURABLE else tiers.local
        plan = self._plan_alone(source, wanted, shares.iteration)
        try:
            resumed = self._restore(plan, source, state, tier=tier, alone=True)
        except (CorruptCheckpointError, CheckpointMismatchError) as e:
            self._log_on_rank0(
                "the shares of %s cannot be read where they are (%s); every rank reads the durable tier %s",
                layout.format_iteration(shares.iteration),
                e,
                self._root.url,
            )
            return None
        tiers.resumed_from_shares(resumed)
        return resumed

    def _log_on_rank0(self, message: str, *args: Any) -> None:
        if self._collectives.rank == 0:
            logger.warning(message, *args)

    # -- 3. the decision --------------------------------------------------------------------------

    def _decide(self, iteration: int | None, wanted: list[str]) -> resume.ResumePlan | None:
        """On rank 0: what to read, or None for a fresh start (said, or refused)."""
        facts = resume.gather(
            self._root, self._load_root, wanted, self._options, self._settings_alone, iteration=iteration
        )
        plan = resume.plan_resume(facts, wanted, self._options)
        if plan is None:
            self._start_fresh(facts.leftovers)
            return None
        if not self._collectives.distributed:
            return plan
        return self._with_metadata(plan) if self._settings_together.cooperative else plan.without_metadata()

    def _with_metadata(self, plan: resume.ResumePlan) -> resume.ResumePlan:
        """On rank 0: ``plan`` with every key's ``.metadata``, for it to reach every rank.

        A cooperative load reads ``.metadata`` once: in the plan rank 0 broadcasts, where a
        failure reaches every rank, rather than in each key's preflight.
        """
        source = self._load_root if plan.from_load_path else self._root
        assert source is not None
        keys = dict(plan.keys)
        for key, where in keys.items():
            if where.metadata is None:
                location = FsspecStorageReader(where.url, retry=self._retry, _fs=source.fs).location
                metadata = read_metadata(location, trust_checkpoint=self._trust_checkpoint)
                keys[key] = dataclasses.replace(where, metadata=metadata)
        return dataclasses.replace(plan, keys=keys)

    def _start_fresh(self, leftovers: str | None) -> None:
        """Say that nothing was resumed: at WARNING, at INFO where a new run is expected
        (``missing_ok``), or raise where resuming is required."""
        url = self._root.url
        if self._options.missing_ok and not leftovers:
            logger.info("nothing to resume under %s (a new run): training from scratch at iteration 0", url)
            return
        if leftovers:
            found = f"it holds {leftovers}"
            advice = "if you meant another save_dirname, fix it; to start over here, empty the folder"
        else:
            found = "it is empty or does not exist, and there is no load_path"
            advice = "if you meant to resume, check save_dirname for a typo"
        if self._options.required:
            raise CheckpointNotFoundError(
                f"nothing to resume under {url}: {found}; {advice} "
                "(ResumeOptions(required=True) refuses to train from scratch)"
            )
        options = "ResumeOptions(required=True) makes this an error"
        if not leftovers:
            options += "; for a new run, ResumeOptions(missing_ok=True) makes it INFO"
        logger.warning(
            "nothing to resume under %s: %s; training from scratch at iteration 0. %s (%s)",
            url,
            found,
            advice[0].upper() + advice[1:],
            options,
        )

    # -- 4 to 6. preflight, reads, agreement ------------------------------------------------------

    def _restore(
        self,
        plan: resume.ResumePlan,
        source: Location,
        state: dict[str, Any],
        *,
        tier: str | None,
        alone: bool = False,
    ) -> int:
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
        # Cooperative where the ranks read one copy together: not a local tier (each rank's own).
        together = self._collectives.distributed and tier != LOCAL and not alone
        settings = self._settings_together if together else self._settings_alone
        reader_options = dict(
            settings=settings, retry=self._retry, process_group=self._collectives.group, _fs=source.fs
        )
        # The model first: optimizers are restored by the names of its parameters.
        ordered = [(k, plan.keys[k]) for k in sorted(plan.keys, key=lambda k: k != MODEL_KEY)]
        start = time.perf_counter()
        try:
            checked = preflight.check_keys(
                ordered,
                state,
                model=state.get(MODEL_KEY),
                reader_options=reader_options,
                new_planner=self._new_planner,
                collectives=self._collectives,
                alone=alone,
            )
            nbytes = self._read_and_apply(ordered, checked, state, alone=alone)
        except CorruptCheckpointError as e:
            if plan.from_load_path or tier == LOCAL or alone:
                raise
            raise self._with_fallback_advice(e, plan.iteration) from e
        event = CheckpointEvent(
            "load_end",
            plan.iteration,
            plan.source,
            tuple(plan.keys),
            nbytes,
            time.perf_counter() - start,
            tier=tier,
        )
        report(event, self._on_event)
        if self._collectives.rank == 0:
            logger.info(
                "resumed %s from %s%s",
                sorted(plan.keys),
                plan.source,
                "" if tier is None else f" ({tier} tier)",
            )
        return plan.iteration

    def _read_and_apply(
        self,
        ordered: list[tuple[str, KeyToLoad]],
        checked: dict[str, preflight.CheckedKey],
        state: dict[str, Any],
        *,
        alone: bool,
    ) -> int:
        """Read every checked key and restore it into its live object, in order; the bytes read."""
        side_by_side = self._keys_at_once(checked)
        if side_by_side:
            self._read_keys_at_once(ordered, checked)
        applied: list[str] = []
        nbytes = 0
        for key, where in ordered:
            try:
                if not side_by_side:
                    self._read_key(key, where, checked[key], alone=alone)
                state_mod.restore(
                    key,
                    state[key],
                    checked[key].state_dict,
                    model=state.get(MODEL_KEY),
                    strict=self._options.strict,
                )
            except CorruptCheckpointError as e:
                raise preflight.partly_loaded(e, key, applied) from e
            applied.append(key)
            nbytes += tensor_nbytes(checked[key].state_dict)
        return nbytes

    def _keys_at_once(self, checked: dict[str, preflight.CheckedKey]) -> bool:
        """Whether the keys may be read side by side.

        As the save writes them (see :meth:`~dcp_fsspec.checkpoint.save.pipeline.SavePipeline._keys_at_once`): on one rank,
        while the whole state fits one reader's window (so several readers hold no more memory
        than one would), and where a read costs a round trip (on local disk one key's reader
        has its own threads).
        """
        return (
            len(checked) > 1
            and not self._collectives.distributed
            and not all(c.reader.location.answers_locally for c in checked.values())
            and sum(tensor_nbytes(c.state_dict) for c in checked.values())
            <= self._reader_settings.window_bytes
        )

    def _read_keys_at_once(
        self, ordered: list[tuple[str, KeyToLoad]], checked: dict[str, preflight.CheckedKey]
    ) -> None:
        """One rank: read every key's data at once; they are restored afterwards, in order.

        Keys are independent DCP checkpoints, so a small load costs the round trips of one key.

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
        """Read one checked key's tensors into its state dict (``alone``: see :meth:`_restore`)."""
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
        return preflight.CheckedPlanner(
            allow_partial_load=not self._options.strict, trust_checkpoint=self._trust_checkpoint
        )

    def _with_fallback_advice(self, error: CorruptCheckpointError, iteration: int) -> CorruptCheckpointError:
        """``error``, saying which older committed iteration ``load(iteration=…)`` can resume instead."""
        older = [i for i in run_listing.committed_iterations(self._root) if i < iteration]
        advice = (
            f"; to resume from the previous committed iteration instead, call load(iteration={older[-1]}, ...)"
            if older
            else f"; no older committed iteration is under {self._root.url} to fall back to"
        )
        return type(error)(f"{error}{advice}")
