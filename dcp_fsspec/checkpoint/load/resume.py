"""The resume rules: what ``Checkpointer.load`` reads, decided from a few facts about storage.

Two halves, so the rules can be read and tested without storage: :func:`gather` asks storage the
few questions the rules need (does ``save_dirname``'s pointer name a committed iteration; if
not, what is at ``load_path``) and returns :class:`ResumeFacts`; :func:`plan_resume`, a pure
function of those facts and the :class:`ResumeOptions`, returns a :class:`ResumePlan` (which
DCP checkpoint each key is read from), ``None`` for a fresh start, or raises an error naming the
URL. The rules, in order: the iteration the pointer under ``save_dirname`` names, every key
given that it saved; else ``load_path`` (an iteration folder, another run's ``save_dirname``
with a pointer, or a single DCP checkpoint of the model, plain or saved as
``dcp.save({"model": state})``): the model, and the scheduler with
``only_load_scheduler_state``, or every key with ``load_training_state``; else nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import Metadata

from dcp_fsspec.checkpoint.commit import layout, loadable, pointer, run_listing
from dcp_fsspec.checkpoint.options import ResumeOptions
from dcp_fsspec.errors import CheckpointNotFoundError
from dcp_fsspec.storage.format.names import METADATA_NAME, POINTER_NAME
from dcp_fsspec.storage.read.reader import FsspecStorageReader
from dcp_fsspec.storage.settings import ReaderSettings
from dcp_fsspec.storage.transport.urls import Location

MODEL_KEY = "model"
SCHEDULER_KEY = "scheduler"

# What a URL holds, as far as resuming goes.
POINTER = "pointer"  # a latest_checkpoint.txt naming a committed iteration folder
CHECKPOINT = "checkpoint"  # a single DCP checkpoint: .metadata at the URL itself
FOLDER = "folder"  # neither: taken as an iteration folder, its keys in subfolders


@dataclass(frozen=True)
class Found:
    """What one URL holds, as far as resuming goes.

    Attributes:
        kind: :data:`POINTER`, :data:`CHECKPOINT` or :data:`FOLDER`.
        url: the URL looked at.
        folder: the iteration folder read (for a pointer, the one it names), for messages.
        iteration: the iteration the pointer names, or the one in a folder's name (if any).
        keys: each finished key found → its DCP checkpoint's URL (a pointer's: those its commit
            record lists; a folder's: those asked about that have ``.metadata``).
        entries: a single checkpoint's entry names, from its ``.metadata``.
        metadata: each key → its ``.metadata`` as the token check read it (a pointer's):
            parsed, or its bytes.
        file_sizes: each key → the files in its folder → their sizes, as the same round trip
            listed them (a pointer's).
    """

    kind: str
    url: str
    folder: str
    iteration: int | None = None
    keys: dict[str, str] = field(default_factory=dict)
    entries: tuple[str, ...] = ()
    metadata: dict[str, Metadata | bytes] = field(default_factory=dict, repr=False)
    file_sizes: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class ResumeFacts:
    """What :func:`gather` learned from storage.

    Attributes:
        save_dirname: the committed iteration the pointer under ``save_dirname`` names; ``None``
            when there is no pointer.
        load_path: what ``load_path`` holds; ``None`` when there is none, or it was not looked
            at because the pointer under ``save_dirname`` wins.
        leftovers: what ``save_dirname`` holds although it has no pointer (iteration folders of
            saves that never moved it, other files), in words; ``None`` when it is empty or absent.
            A fresh start over such a folder is logged as a warning: a mistyped ``save_dirname``
            must not silently train from scratch.
    """

    save_dirname: Found | None
    load_path: Found | None = None
    leftovers: str | None = None


@dataclass(frozen=True)
class KeyToLoad:
    """Where one key is read from.

    Attributes:
        url: the DCP checkpoint.
        nested_under: the checkpoint holds ``{nested_under: state_dict}`` (its entries are named
            ``model.…``), as ``dcp.save({"model": state})`` writes; ``None``: the state dict itself.
        metadata: its ``.metadata`` where the resume rules read it already: as their token
            check parsed it, or its bytes (the load parses them instead of reading them again);
            ``None``: the load reads it.
        file_sizes: the files in its folder → their sizes, where the resume rules listed them
            already (the load checks its data files against them rather than listing again);
            ``None``: the load lists them.
    """

    url: str
    nested_under: str | None = None
    metadata: Metadata | bytes | None = field(default=None, repr=False)
    file_sizes: dict[str, int] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ResumePlan:
    """What ``load`` reads, decided on rank 0 and broadcast.

    Attributes:
        source: the iteration folder (or single checkpoint) read, for messages.
        iteration: the iteration ``load`` returns.
        keys: each key to load → where from.
        from_load_path: read with ``load_storage_options`` rather than ``storage_options``.
        notes: ``(logging level, message)`` for rank 0 to log: keys skipped, names not understood.
    """

    source: str
    iteration: int
    keys: dict[str, KeyToLoad]
    from_load_path: bool
    notes: tuple[tuple[int, str], ...] = ()

    def without_metadata(self) -> ResumePlan:
        """This plan without the ``.metadata`` bytes (and listings), for rank 0 to broadcast:
        every rank reads them itself rather than a large model's metadata going through the
        process group."""
        keys = {k: dataclasses.replace(v, metadata=None, file_sizes=None) for k, v in self.keys.items()}
        return dataclasses.replace(self, keys=keys)


def load_path_keys(wanted: Sequence[str], options: ResumeOptions) -> list[str]:
    """The keys of ``wanted`` that ``load_path`` provides under ``options``."""
    if options.load_training_state:
        return list(wanted)
    taken = {MODEL_KEY, SCHEDULER_KEY} if options.only_load_scheduler_state else {MODEL_KEY}
    return [k for k in wanted if k in taken]


# -- facts (storage) ------------------------------------------------------------------------------


def gather(
    root: Location,
    load_root: Location | None,
    wanted: Sequence[str],
    options: ResumeOptions,
    reader: ReaderSettings,
    *,
    iteration: int | None = None,
) -> ResumeFacts:
    """Ask storage what :func:`plan_resume` needs: a few calls, on rank 0.

    Args:
        root: the ``save_dirname`` location.
        load_root: the ``load_path`` location, if any.
        wanted: the keys ``load`` should restore.
        options: which keys ``load_path`` provides (only those are looked for there).
        reader: the reader's tuning, for reading a single checkpoint's ``.metadata``; with
            ``trust_checkpoint``, every ``.metadata`` is unpickled in full.
        iteration: read this committed iteration of ``save_dirname`` instead of the one the
            pointer names (``load(iteration=N)``); ``load_path`` is then not looked at.

    Raises:
        CheckpointNotFoundError: a pointer (or ``iteration``) names a folder that is not a
            committed iteration.
        CorruptCheckpointError: a pointer does not hold an iteration folder name, or a single
            checkpoint's ``.metadata`` is damaged.
        StorageError: the backend failed.
    """
    trust_checkpoint = reader.trust_checkpoint
    if iteration is not None:
        named_by = f"load(iteration={iteration}) for {root.url}"
        return ResumeFacts(_committed(root, iteration, named_by=named_by, trust_checkpoint=trust_checkpoint))
    own = _named_by_pointer(root, trust_checkpoint)
    if own is not None:
        return ResumeFacts(own)
    leftovers = _leftovers(root)
    if load_root is None:
        return ResumeFacts(None, leftovers=leftovers)
    found = _look_at_load_path(load_root, load_path_keys(wanted, options), reader)
    return ResumeFacts(None, found, leftovers)


def _named_by_pointer(root: Location, trust_checkpoint: bool) -> Found | None:
    latest = pointer.read_pointer(root)
    if latest is None:
        return None
    return _committed(root, latest, named_by=None, trust_checkpoint=trust_checkpoint)


def _committed(root: Location, iteration: int, *, named_by: str | None, trust_checkpoint: bool) -> Found:
    record, read = loadable.require_loadable(
        root, iteration, named_by=named_by, trust_checkpoint=trust_checkpoint
    )
    keys = {k: root.url_of(layout.key_path(root, iteration, k)) for k in record.keys}
    metadata = {k: read.parsed.get(k, raw) for k, raw in read.metadata.items() if raw is not None}
    sizes = {k: read.sizes_in(layout.key_path(root, iteration, k)) for k in record.keys}
    folder = root.url_of(layout.iteration_path(root, iteration))
    return Found(POINTER, root.url, folder, iteration, keys, metadata=metadata, file_sizes=sizes)


def _leftovers(root: Location) -> str | None:
    """What ``save_dirname`` holds without a pointer, in words (None: nothing, or no folder)."""
    iterations = layout.list_iterations(root)
    if iterations:
        names = [layout.format_iteration(i) for i in iterations]
        shown = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        return (
            f"{len(names)} iteration folder(s) ({shown}) but no {POINTER_NAME}, so none of them "
            "was ever published as the latest checkpoint"
        )
    try:
        entries = root.backend.call("ls", root.path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    names = sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)
    if not names:
        return None
    shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
    return f"{len(names)} entries that are not iteration folders ({shown})"


def _look_at_load_path(source: Location, keys: list[str], reader: ReaderSettings) -> Found:
    entries = _checkpoint_entries(source, reader)
    if entries is not None:
        return Found(CHECKPOINT, source.url, source.url, entries=entries)
    pointed = _named_by_pointer(source, reader.trust_checkpoint)
    if pointed is not None:
        return pointed
    saved = {
        k: source.url_of(source.join(k))
        for k in keys
        if run_listing.exists(source, posixpath.join(source.join(k), METADATA_NAME))
    }
    return Found(FOLDER, source.url, source.url, layout.parse_iteration(source.path), saved)


def _checkpoint_entries(source: Location, reader: ReaderSettings) -> tuple[str, ...] | None:
    """The entry names in the ``.metadata`` of a single DCP checkpoint at ``source``, or None."""
    try:
        metadata = FsspecStorageReader(
            source.url, settings=reader, retry=source.retry, _fs=source.fs
        ).read_metadata()
    except CheckpointNotFoundError:
        return None
    return tuple(metadata.state_dict_metadata)


# -- the decision (pure) --------------------------------------------------------------------------


def plan_resume(facts: ResumeFacts, wanted: Sequence[str], options: ResumeOptions) -> ResumePlan | None:
    """What ``load`` reads, from ``facts`` alone; ``None``: a fresh start.

    Args:
        facts: what :func:`gather` learned.
        wanted: the keys ``load`` should restore (after ``keys_not_to_resume``, ``load_optimizer``).
        options: the resume options.

    Raises:
        CheckpointNotFoundError: ``load_path`` holds no checkpoint of the keys it should provide,
            or (with ``strict``) the checkpoint read lacks a key wanted; the message names
            the URL.
    """
    own, found = facts.save_dirname, facts.load_path
    if own is not None:
        return _select(own, own.iteration or 0, list(wanted), options, from_load_path=False)
    if found is None:
        return None
    keys = load_path_keys(wanted, options)
    if found.kind == CHECKPOINT:
        return _from_single_checkpoint(found, keys, options)
    if found.kind == FOLDER and not found.keys:
        raise CheckpointNotFoundError(
            f"load_path {found.url} holds no DCP checkpoint of {keys} (no {METADATA_NAME} there nor in "
            f"a key subfolder, and no {POINTER_NAME}); check the URL"
        )
    iteration = 0
    notes: tuple[tuple[int, str], ...] = ()
    if options.load_training_state:
        if found.iteration is None:
            notes = (
                (logging.WARNING, f"load_path {found.url} is not named iter_…; resuming at iteration 0"),
            )
        iteration = found.iteration or 0
    return _select(found, iteration, keys, options, from_load_path=True, notes=notes)


def _select(
    found: Found,
    iteration: int,
    keys: list[str],
    options: ResumeOptions,
    *,
    from_load_path: bool,
    notes: tuple[tuple[int, str], ...] = (),
) -> ResumePlan:
    missing = [k for k in keys if k not in found.keys]
    notes += _missing(missing, found.folder, tuple(found.keys), options)
    chosen = {
        k: KeyToLoad(found.keys[k], metadata=found.metadata.get(k), file_sizes=found.file_sizes.get(k))
        for k in keys
        if k in found.keys
    }
    return ResumePlan(found.folder, iteration, chosen, from_load_path, notes)


def _from_single_checkpoint(found: Found, keys: list[str], options: ResumeOptions) -> ResumePlan:
    """A single DCP checkpoint is the model's weights, and nothing else.

    Its entries say how it was saved: all named ``model.…`` is ``dcp.save({"model": state})``
    (the original trainer's layout for RL models), anything else the model's state dict itself.
    """
    prefix = MODEL_KEY + "."
    nested = MODEL_KEY if found.entries and all(e.startswith(prefix) for e in found.entries) else None
    asked_by = "load_training_state" if options.load_training_state else "only_load_scheduler_state"
    notes = _missing(
        [k for k in keys if k != MODEL_KEY],
        f"load_path {found.url}, a single DCP checkpoint taken as the model,",
        (MODEL_KEY,),
        options,
        fix=f"set {asked_by}=False, or point load_path at an iteration folder",
    )
    chosen = {MODEL_KEY: KeyToLoad(found.url, nested)} if MODEL_KEY in keys else {}
    return ResumePlan(found.url, 0, chosen, True, notes)


def _missing(
    missing: list[str], where: str, saved: tuple[str, ...], options: ResumeOptions, *, fix: str = ""
) -> tuple[tuple[int, str], ...]:
    """Keys wanted that the checkpoint lacks: an error if strict, else a note to log."""
    if not missing:
        return ()
    if options.strict:
        raise CheckpointNotFoundError(
            f"checkpoint {where} has no key(s) {missing} (it holds {sorted(saved)}); "
            f"{fix or 'pass ResumeOptions(strict=False) to skip them, or list them in keys_not_to_resume'}"
        )
    return ((logging.INFO, f"checkpoint {where} has no key(s) {missing}; they keep their current values"),)
