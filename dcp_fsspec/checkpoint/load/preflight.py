"""Checking every key of a load before any of them is applied.

``Checkpointer.load`` restores several keys (model, optimizer, scheduler, …), each its own DCP
checkpoint, one after the other: if the second failed once the first was applied, the model
would be restored and the optimizer not. So before the first byte lands, every rank checks every
key as far as it can without reading tensor data: its ``.metadata`` decodes (and is allowed,
:mod:`~dcp_fsspec.storage.format.safe_entries`), the live state dict fits it (DCP's planner: every entry is in
the checkpoint, every tensor has the saved shape), and every data file the rank will read is
there with at least the bytes of its records (the reader's ``prepare_local_plan``: one listing
per key). The ranks then agree; one failure fails every rank, with nothing applied anywhere.

What still fails mid-way is what only the bytes themselves show: a checksum mismatch, a record
damaged inside a file of the right size. The load's error then says which keys may be partly
restored (:func:`partly_loaded`).

The load reuses what the check read and planned: the same readers, whose ``.metadata`` is not
read again and whose files are not listed again, and the same planners, which do not flatten
and plan the state dict again, so the check costs one listing per key and rank, and nothing
else, over a load without it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.tensor import DTensor

from dcp_fsspec.checkpoint import state as state_mod
from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.checkpoint.commit.at_once import at_once
from dcp_fsspec.checkpoint.commit.loadable import require_referable
from dcp_fsspec.checkpoint.load.resume import KeyToLoad
from dcp_fsspec.errors import CheckpointMismatchError, CorruptCheckpointError, DcpFsspecError
from dcp_fsspec.storage.format.metadata_file import parse_metadata
from dcp_fsspec.storage.format.names import METADATA_NAME
from dcp_fsspec.storage.format.safe_entries import SafeLoadPlanner
from dcp_fsspec.storage.read.reader import FsspecStorageReader


class CheckedPlanner(SafeLoadPlanner):
    """The load planner a key is checked with and then loaded with.

    ``dcp.load`` sets its planner up and plans again what the check planned: the state dict it
    is given (a copy of its top level, same values) against the same ``.metadata``. Where that
    is so, this planner keeps the check's flattened state dict and plan and only points its
    top level at the copy (where ``load_bytes`` puts top-level values and ``dcp.load`` takes
    them back from); anything else is set up and planned afresh.
    """

    _checked: tuple[dict[str, Any], Metadata | None, bool, LoadPlan] | None = None
    _planned: LoadPlan | None = None

    def remember(self, plan: LoadPlan) -> None:
        """Keep ``plan``, just made from the current set-up, for the load's set-up of the same."""
        self._checked = (self.original_state_dict, self.metadata, self.is_coordinator, plan)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        checked, self._checked, self._planned = self._checked, None, None
        if checked is not None:
            checked_state_dict, checked_metadata, checked_coordinator, plan = checked
            if (
                metadata is checked_metadata
                and is_coordinator == checked_coordinator
                and _same_top_level(state_dict, checked_state_dict)
            ):
                self.original_state_dict = state_dict
                self._planned = plan
                return
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        planned, self._planned = self._planned, None
        return planned if planned is not None else super().create_local_plan()


def _same_top_level(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``a`` and ``b`` hold the same objects under the same keys (a shallow copy)."""
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


@dataclass(frozen=True)
class CheckedKey:
    """One key of a load, checked against its checkpoint on this rank.

    Attributes:
        state_dict: the key's state dict (:func:`~dcp_fsspec.checkpoint.state.state_dict_for`), which
            :func:`~dcp_fsspec.checkpoint.state.restore` puts back into the live object once ``dcp.load`` filled it.
        target: what ``dcp.load`` fills: ``state_dict``, or ``{nested_under: state_dict}``.
        reader: the reader to load with; it already holds the key's ``.metadata`` and checked files.
        planner: the planner to load with; it already holds the check's plan of ``target``.
    """

    state_dict: dict[str, Any]
    target: dict[str, Any]
    reader: _CheckedReader
    planner: CheckedPlanner


class _CheckedReader(FsspecStorageReader):
    """A reader that hands DCP the ``.metadata`` the preflight read, and skips checking the
    files of a plan the preflight already checked."""

    # The .metadata read, per data file the end of the last record checked there, and the plan.
    _checked: tuple[Metadata, dict[str, tuple[int, str]], LoadPlan] | None = None
    # .metadata where the resume rules read it already, parsed or as bytes (KeyToLoad.metadata).
    _given: Metadata | bytes | None = None
    # The key folder's files → sizes, where the resume rules listed them (KeyToLoad.file_sizes).
    _given_sizes: dict[str, int] | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._checked is None and self._given is not None and kwargs.get("rank") is None:
            return self._parse_given(self._given)
        if self._checked is None:
            return super().read_metadata(*args, **kwargs)
        metadata = self._checked[0]
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def _parse_given(self, given: Metadata | bytes) -> Metadata:
        """``.metadata`` as the resume rules read it: parsed by their token check already, or
        its bytes, parsed here and checked as a read of it is."""
        if isinstance(given, Metadata):
            metadata = given
        else:
            try:
                metadata = parse_metadata(
                    given,
                    self.location.url_of(self.location.join(METADATA_NAME)),
                    trust_checkpoint=self.trust_checkpoint,
                )
            except DcpFsspecError as e:
                self.metadata_failure = self.metadata_failure or e
                raise
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _listed_sizes(self, folders: set[str]) -> dict[str, int]:
        if self._given_sizes is not None and folders == {""}:  # the key's own folder, listed already
            return self._given_sizes
        return super()._listed_sizes(folders)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # The check's own plan (its planner hands it to dcp.load), or one that reads the same.
        if self._checked is not None and (
            plan is self._checked[2] or self._needed_ends(plan) == self._checked[1]
        ):
            return plan
        return super().prepare_local_plan(plan)

    def check(
        self, target: dict[str, Any], planner: CheckedPlanner, is_coordinator: bool, *, covered: bool = False
    ) -> None:
        """Plan the load of ``target`` as ``dcp.load`` does, and check the files the plan reads.

        ``covered``: also check that the plan fills every element of every entry it loads (a
        checkpoint of one rank's share may hold less of a tensor than this rank now holds).
        """
        metadata = self.read_metadata()
        if is_coordinator and metadata.storage_data:
            require_referable(self.location, (info.relative_path for info in metadata.storage_data.values()))
        planner.set_up_planner(target, metadata, is_coordinator)
        self.set_up_storage_reader(metadata, is_coordinator)
        try:
            plan = planner.create_local_plan()
        except DcpFsspecError:
            raise
        except Exception as e:  # DCP's planner: a missing entry (RuntimeError), a shape (ValueError)
            raise CheckpointMismatchError(
                f"the checkpoint at {self.location.url} does not fit the state given to load(): "
                f"{type(e).__name__}: {e}; nothing was loaded. Load it into the model it was saved from "
                "(same parameter names and shapes), or pass ResumeOptions(strict=False) to skip missing entries"
            ) from e
        problem = _uncovered(planner, plan, metadata) if covered else None
        if problem is not None:
            raise CheckpointMismatchError(
                f"the checkpoint at {self.location.url} does not hold all this rank loads: {problem}; nothing was loaded"
            )
        self.prepare_local_plan(plan)
        self._checked = (metadata, self._needed_ends(plan), plan)
        planner.remember(plan)


def _uncovered(planner: LoadPlanner, plan: LoadPlan, metadata: Metadata) -> str | None:
    """The first entry of the planner's state dict that ``plan`` reads only in part, in words.

    A chunk a checkpoint holds is read only where it overlaps the tensor this rank holds (DCP's
    planner), and one save's chunks do not overlap: the elements read add up to the tensor's
    exactly when every element is read.
    """
    read: dict[str, int] = defaultdict(int)
    for item in plan.items:
        read[item.dest_index.fqn] += 1 if item.type == LoadItemType.BYTE_IO else math.prod(item.lengths)
    state_dict = getattr(planner, "state_dict", {})  # DefaultLoadPlanner's, flattened as DCP loads it
    for fqn in metadata.state_dict_metadata.keys() & state_dict.keys():
        value = state_dict[fqn]
        if isinstance(value, DTensor):
            value = value.to_local()  # what DCP reads into: this rank's shard
        needed = value.numel() if isinstance(value, torch.Tensor) else 1
        if read[fqn] != needed:
            return f"entry {fqn!r}: {read[fqn]} of its {needed} elements on this rank"
    return None


def check_keys(
    keys: Sequence[tuple[str, KeyToLoad]],
    values: Mapping[str, Any],
    *,
    model: Any,
    reader_options: dict[str, Any],
    new_planner: Callable[[], CheckedPlanner],
    collectives: Collectives,
    alone: bool = False,
) -> dict[str, CheckedKey]:
    """Check every key of a load on every rank; raise on every rank if any rank failed.

    Args:
        keys: each key to load and where from, in the order they will be loaded.
        values: the live objects given to ``load``, by key.
        model: the value given as ``model=`` (optimizers are loaded by its parameter names).
        reader_options: keywords for each key's :class:`~dcp_fsspec.storage.read.reader.FsspecStorageReader`.
        new_planner: makes a key's load planner (each :class:`CheckedKey` keeps its own).
        collectives: the ranks that agree.
        alone: each rank loads a checkpoint of its own (a per-node local tier): each plans as
            the coordinator, and its copy must cover every entry it loads in full.

    Returns:
        Each key's :class:`CheckedKey`, to load with.

    Raises:
        CorruptCheckpointError: a ``.metadata`` is damaged or refused, or a data file is missing
            or too short.
        CheckpointMismatchError: a key's state does not fit its checkpoint (a missing entry, a shape).
        StorageError: the backend failed.
    """
    checked: dict[str, CheckedKey] = {}
    error: Exception | None = None
    try:
        for key, where in keys:
            state_dict = state_mod.state_dict_for(key, values[key], model=model)
            # DCP flattens nested dicts, so {"model": sd} receives the entries saved as "model.…".
            target = state_dict if where.nested_under is None else {where.nested_under: state_dict}
            reader = _CheckedReader(where.url, **reader_options)
            reader._given, reader._given_sizes = where.metadata, where.file_sizes
            checked[key] = CheckedKey(state_dict, target, reader, new_planner())
        checks = [
            partial(c.reader.check, c.target, c.planner, alone or collectives.rank == 0, covered=alone)
            for c in checked.values()
        ]
        # The checks read each key's .metadata and list its folder: on one rank, every key's at
        # once (one round trip). With other ranks, one after another, as DCP's planners run there.
        if collectives.distributed:
            for check in checks:
                check()
        else:
            at_once(checks, one_by_one=all(c.reader.location.answers_locally for c in checked.values()))
    except Exception as e:  # re-raised below, on every rank
        error = e
    collectives.raise_if_any_failed(error)
    return checked


def partly_loaded(error: CorruptCheckpointError, key: str, applied: Sequence[str]) -> CorruptCheckpointError:
    """``error`` (damage found while loading ``key``), saying what the load had changed by then."""
    done = f"keys {list(applied)} were restored and " if applied else ""
    return type(error)(f"{error} ({done}key {key!r} may be partly loaded: load again from a good checkpoint)")
