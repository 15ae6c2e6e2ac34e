"""The Checkpointer's grouped options: what ``load`` resumes, the local tier, and all of them.

Each group is a frozen dataclass that checks its own values when built, so a mistake is named
where it is made. They hold no storage: the Checkpointer resolves their URLs.
:class:`CheckpointerOptions` holds every keyword-only option, for code that builds a Checkpointer
on a user's behalf (the integrations).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dcp_fsspec.errors import UsageError
from dcp_fsspec.storage.settings import ReaderSettings, WriterSettings
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, RetryPolicy
from dcp_fsspec.storage.transport.urls import redact_url

if TYPE_CHECKING:
    import torch.distributed as dist

    from dcp_fsspec.checkpoint.events import Callback

DRAIN_EVERY = "every"
DRAIN_LATEST = "latest"
DRAIN_POLICIES = (DRAIN_EVERY, DRAIN_LATEST)


@dataclass(frozen=True)
class ResumeOptions:
    """What :meth:`Checkpointer.load <dcp_fsspec.Checkpointer.load>` restores, and from where.

    Attributes:
        load_path: initial weights for a run with nothing under ``save_dirname`` yet: an
            iteration folder (``…/iter_000000100``), a ``save_dirname`` with a pointer, or a single
            DCP checkpoint of the model (its state dict, or ``{"model": state_dict}`` as
            ``dcp.save({"model": state})`` writes it: told apart by the names in its metadata).
        load_storage_options: fsspec options for ``load_path``; default: ``save_dirname``'s.
        load_training_state: with ``load_path``, load every key given to ``load``, not only
            ``model``, and return the iteration in the folder's name.
        only_load_scheduler_state: with ``load_path``, load the ``scheduler`` key from it too,
            besides ``model`` (a new run that continues a schedule); ``load`` still returns 0.
        strict: a key given to ``load`` that the checkpoint lacks is an error; with False it is
            skipped (logged), and so are entries missing inside a key.
        load_optimizer: False skips the ``optim`` key (and any other optimizer).
        keys_not_to_resume: keys ``load`` leaves as they are.
        required: ``load`` raises :class:`~dcp_fsspec.errors.CheckpointNotFoundError` instead of
            training from scratch when there is nothing to resume (a job that must continue a
            run). By default a fresh start is logged at WARNING with the URL.
        missing_ok: a fresh start is expected where ``save_dirname`` is empty or absent (a new
            run): it is logged at INFO, not WARNING. Only the caller knows a new run from a
            mistyped ``save_dirname``, so the warning is the default. A folder that holds files
            but no pointer is still a WARNING.

    Raises:
        ValueError: both ``load_training_state`` and ``only_load_scheduler_state``, or both
            ``required`` and ``missing_ok``.
        TypeError: ``keys_not_to_resume`` is a string, not a list of keys.
    """

    load_path: str | os.PathLike[str] | None = None
    load_storage_options: dict[str, Any] | None = field(default=None, repr=False)
    load_training_state: bool = False
    only_load_scheduler_state: bool = False
    strict: bool = True
    load_optimizer: bool = True
    keys_not_to_resume: tuple[str, ...] = ()
    required: bool = False
    missing_ok: bool = False

    def __post_init__(self) -> None:
        if self.required and self.missing_ok:
            raise ValueError(
                "ResumeOptions(required=True, missing_ok=True): required refuses a fresh start and "
                "missing_ok expects one; pass one of them"
            )
        if isinstance(self.keys_not_to_resume, str):
            raise TypeError(
                f"keys_not_to_resume must be a list of keys, got the string {self.keys_not_to_resume!r}"
            )
        object.__setattr__(self, "keys_not_to_resume", tuple(self.keys_not_to_resume))
        if self.load_training_state and self.only_load_scheduler_state:
            source = None if self.load_path is None else redact_url(os.fspath(self.load_path))
            raise ValueError(
                f"ResumeOptions(load_path={source!r}): load_training_state=True loads every key from load_path, "
                "the scheduler included, and only_load_scheduler_state=True only the model and the scheduler; "
                "pass one of them"
            )


@dataclass(frozen=True)
class LocalTier:
    """A fast local tier: each save commits here first, then drains to ``save_dirname``.

    Same layout as ``save_dirname``, with its own pointer. ``load`` resumes the newest iteration
    every rank can read, from here where it is committed and complete. One folder every rank
    sees (one node, or a shared file system) holds one checkpoint for all ranks. A folder each
    node has to itself (per-node NVMe at the same path; found by a probe, logged) holds each
    rank's share under ``rank{r}/``, and the drain merges them into one plain checkpoint.

    Attributes:
        dirname: node-local disk; any fsspec URL or local path.
        storage_options: fsspec options for ``dirname``.
        keep_last_n: how many committed iterations the local tier keeps (>= 1); never one still
            to drain, nor the newest.
        drain: when saves come faster than drains. ``"every"``: ``save`` waits for the drain in
            flight, every iteration goes up. ``"latest"``: an iteration waiting to drain is
            replaced by the newer one (logged). A failed drain does not stop training: the next
            ``save`` warns and drains again; ``wait`` and ``finalize`` raise
            :class:`~dcp_fsspec.errors.DrainError` while the durable tier is behind.
        replicas: how many copies of each rank's local share exist, its own included. With
            ``replicas=F`` >= 2 (per-node mode only), each save's local copy is also sent to
            ``F - 1`` ranks on other nodes, in the background; a rank whose node is lost resumes
            from them, the durable tier only for what no peer holds. Each node needs about
            ``F`` times its own share of disk. See docs/two-tiers.md.
        node: this rank's node (e.g. the host name): ranks with one name share a disk. Default:
            found by a probe file in ``dirname``.

    Raises:
        ValueError: ``keep_last_n`` or ``replicas`` below 1, or an unknown ``drain``.
    """

    dirname: str | os.PathLike[str]
    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    keep_last_n: int = 1
    drain: str = DRAIN_EVERY
    replicas: int = 1
    node: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"LocalTier replicas must be an int >= 1 (1: no copies), got {self.replicas!r}")
        if (
            isinstance(self.keep_last_n, bool)
            or not isinstance(self.keep_last_n, int)
            or self.keep_last_n < 1
        ):
            raise ValueError(f"LocalTier keep_last_n must be an int >= 1, got {self.keep_last_n!r}")
        if self.drain not in DRAIN_POLICIES:
            raise ValueError(
                f"LocalTier drain={self.drain!r} is not supported; choose one of {list(DRAIN_POLICIES)}"
            )


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every keyword-only option of the :class:`~dcp_fsspec.Checkpointer`, as one value.

    The integrations that build a Checkpointer for you take one of these and pass it on whole,
    so each of them takes every option the Checkpointer takes. Each field is the Checkpointer's
    keyword of the same name, with the same default: see its docstring. An integration may
    decide some fields itself (Hugging Face's ``save_total_limit`` is the retention); giving one
    of those here is an error that names it.
    """

    async_mode: str = "disabled"
    keep_last_n: int | None = None
    resume: ResumeOptions | None = None
    local_tier: LocalTier | None = None
    overwrite: bool = False
    process_group: dist.ProcessGroup | None = None
    verify_before_commit: bool = False
    incremental: bool = False
    on_event: Callback | None = None
    retry: RetryPolicy | None = DEFAULT_RETRY
    writer_settings: WriterSettings | None = None
    reader_settings: ReaderSettings | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """The fields by name, to pass as ``**keywords`` to the Checkpointer."""
        return {option.name: getattr(self, option.name) for option in dataclasses.fields(self)}

    def require_default(self, owner: str, reasons: dict[str, str]) -> None:
        """Refuse a field ``owner`` decides itself; ``reasons`` maps each such field to what to do.

        Raises:
            UsageError: one of those fields differs from its default.
        """
        for option in dataclasses.fields(self):
            if option.name in reasons and getattr(self, option.name) != option.default:
                raise UsageError(
                    f"{owner} decides CheckpointerOptions.{option.name} itself: leave it unset and "
                    f"{reasons[option.name]}"
                )
