"""What makes an iteration loadable: committed, every key finished, every key this save's.

A load (:mod:`~dcp_fsspec.checkpoint.load.resume`) and the local tier ask these questions of an iteration before reading
it; the commit (:mod:`~dcp_fsspec.checkpoint.commit.committing`) asks the last one of its own save before writing the record.
Each failure is an error naming the folder, the file and what to do.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from dcp_fsspec.checkpoint.commit import layout, pointer, run_listing
from dcp_fsspec.checkpoint.commit.commit_record import CommitRecord, read_commit_record, referable
from dcp_fsspec.checkpoint.commit.run_listing import FolderRead
from dcp_fsspec.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, METADATA_NAME, POINTER_NAME
from dcp_fsspec.storage.format.references import is_reference, referenced_folders
from dcp_fsspec.storage.transport.urls import Location


def require_committed(root: Location, iteration: int, *, named_by: str | None = None) -> CommitRecord:
    """The commit record of ``iteration``, or a CheckpointNotFoundError naming ``named_by``.

    Args:
        root: the ``save_dirname`` location.
        iteration: the iteration that must be committed.
        named_by: who asked for it (``load(iteration=N)``), so the message names both and
            advises another iteration; ``None``: the pointer named it, and the advice is to
            restore the folder or rewrite the pointer.
    """
    record, reason = run_listing.inspect_iteration(root, iteration)
    if record is None:
        raise _not_committed(root, iteration, str(reason), named_by)
    return record


def require_loadable(
    root: Location, iteration: int, *, named_by: str | None = None, trust_checkpoint: bool = False
) -> tuple[CommitRecord, FolderRead]:
    """:func:`require_committed` and :func:`require_saved_together` in two round trips: the
    commit record, then the folder's listing and every key's ``.metadata`` at once; returns
    the record and what was read of the folder (a load parses those ``.metadata`` again rather
    than reading them again).

    Raises:
        CheckpointNotFoundError: ``iteration`` is not committed (the message names ``named_by``).
        CorruptCheckpointError: the record, or a key's ``.metadata``, is not this save's.
        StorageError: the backend failed.
    """
    record = read_commit_record(root, iteration) or require_committed(root, iteration, named_by=named_by)
    folder = run_listing.read_folder(root, iteration, record.keys)
    unfinished = folder.unfinished(record.keys)
    if unfinished:
        raise _not_committed(
            root, iteration, run_listing.lacks_metadata(root, iteration, unfinished[0]), named_by
        )
    require_saved_together(root, record, trust_checkpoint=trust_checkpoint, folder=folder)
    return record, folder


def _not_committed(
    root: Location, iteration: int, reason: str, named_by: str | None
) -> CheckpointNotFoundError:
    folder = root.url_of(layout.iteration_path(root, iteration))
    committed = [layout.format_iteration(i) for i in run_listing.committed_iterations(root)]
    if named_by is not None:  # load(iteration=N): another N is the way out
        advice = "Load one of those (load(iteration=N))" if committed else "Save one first"
    else:
        named_by = pointer.pointer_url(root)
        advice = f"Restore that folder, or rewrite {POINTER_NAME} to name a committed iteration (or delete it to start over)"
    return CheckpointNotFoundError(
        f"{named_by} names {folder}, which {reason}; committed iterations there: {committed or 'none'}. {advice}"
    )


def require_saved_together(
    root: Location, record: CommitRecord, *, trust_checkpoint: bool = False, folder: FolderRead | None = None
) -> None:
    """Check that every key ``record`` lists is the save that wrote ``record`` (its token).

    A folder two saves of one iteration wrote into is never loaded as one checkpoint. A record
    written before tokens existed (no ``save_id``) is not checked. ``folder``: the folder as the
    caller read it (:func:`read_folder`), else it is read here.

    Raises:
        CorruptCheckpointError: a key's ``.metadata`` carries another save's token, or names a
            missing file; the message names the URL.
        StorageError: the backend failed.
    """
    if record.save_id is None:
        return
    folder = run_listing.read_folder(root, record.iteration, record.keys) if folder is None else folder
    problem = first_key_problem(
        root, record.iteration, record.keys, record.save_id, folder, trust_checkpoint=trust_checkpoint
    )
    if problem is not None:
        raise CorruptCheckpointError(
            f"{root.url_of(layout.iteration_path(root, record.iteration))} is not the checkpoint its {COMMIT_RECORD_NAME} committed: {problem} (another "
            "process saved the same iteration into it); it is not loaded. Load another iteration, "
            "or delete this folder"
        )


def first_key_problem(
    root: Location,
    iteration: int,
    keys: tuple[str, ...],
    save_id: str,
    folder: FolderRead,
    *,
    trust_checkpoint: bool = False,
) -> str | None:
    """Why the first of ``keys`` (in order) that is not the save ``save_id`` wrote is not, in
    words; ``None`` if every key is.

    A key is that save's when its ``.metadata`` (as ``folder`` read it) carries ``save_id`` and
    every data file of its own it names is there (in ``folder``'s listing, or confirmed one by one).
    ``trust_checkpoint``: unpickle ``.metadata`` in full (see :func:`~dcp_fsspec.storage.format.metadata_file.parse_metadata`).

    Raises:
        CorruptCheckpointError: a ``.metadata`` is not DCP metadata.
        StorageError: the backend failed.
    """
    from dcp_fsspec.storage.format.metadata_file import (
        parse_metadata,
    )  # needs torch; ls, prune and cp never get here

    for key in keys:
        key_folder = layout.key_path(root, iteration, key)
        url = root.url_of(posixpath.join(key_folder, METADATA_NAME))
        raw = folder.metadata[key]
        if raw is None:
            return f"{url} does not exist"
        meta = folder.parsed[key] = parse_metadata(raw, url, trust_checkpoint=trust_checkpoint)
        stored = meta.storage_meta
        if stored is None or stored.save_id != save_id:
            return f"{url} was written by another save (save_id {getattr(stored, 'save_id', None)!r}, not {save_id!r})"
        # Its own files; references into other iterations are checked where they are read.
        for name in sorted(
            {i.relative_path for i in (meta.storage_data or {}).values() if not is_reference(i.relative_path)}
        ):
            file_path = posixpath.join(key_folder, name)
            if file_path not in folder.listed and not run_listing.exists(root, file_path):
                return f"{root.url_of(file_path)}, which {url} names, is missing"
    return None


def require_referable(key: Location, data_files: Iterable[str]) -> None:
    """Every iteration a saved key refers to (an incremental save's) is committed, or retired
    with the files it is referred to for kept.

    Args:
        key: the key's folder (``save_dirname/iter_N/key``).
        data_files: the data files its ``.metadata`` names.

    Raises:
        CorruptCheckpointError: naming both iterations.
        StorageError: the backend failed.
    """
    iterations = {
        layout.parse_iteration(posixpath.dirname(folder)) for folder in referenced_folders(data_files)
    }
    root = key.at(posixpath.dirname(posixpath.dirname(key.path)))
    for iteration in sorted(i for i in iterations if i is not None):
        if not referable(root, iteration):
            raise CorruptCheckpointError(
                f"{key.url} refers to records of iteration {iteration} "
                f"({root.url_of(layout.iteration_path(root, iteration))}), which is not committed: it was "
                "deleted or its save never finished; nothing was loaded. Load another iteration"
            )
