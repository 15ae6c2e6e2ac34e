"""Deleting iteration folders: uncommit first, then remove the files, never through a link.

A folder's commit record goes before anything else in it, so a half-deleted folder is an
uncommitted one, never a damaged checkpoint; retention deletes what is left at a later save.
An iteration whose files later iterations refer to is retired instead: a retired mark replaces
its record (:func:`~dcp_fsspec.checkpoint.commit.commit_record.retired_mark`), then only the files nobody refers to go.
Every deletion works in bulk where the store allows. A symbolic link under ``save_dirname`` is
removed itself, never followed: it may lead into another run's checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.checkpoint.commit.commit_record import parse_record, record_path, retired_mark
from dcp_fsspec.storage.transport.urls import Location


def discard_iterations(
    root: Location, iterations: Sequence[int], *, recorded: Sequence[int] | None = None
) -> None:
    """Delete the folders of ``iterations``, uncommitting them all first.

    Args:
        recorded: those that may hold a commit record (default: all); the others are
            uncommitted already (the caller's listing showed no record in them).

    Raises:
        StorageError: the backend failed; the folders may be half deleted, but none is
            committed once its files go, so retention retries them at the next save.
    """
    uncommit_iterations(root, iterations if recorded is None else recorded)
    remove_iterations(root, iterations)


def uncommit_iterations(root: Location, iterations: Sequence[int]) -> None:
    """Delete the commit records of ``iterations``, in bulk: from then on no load, listing or
    resume takes them for checkpoints, and retention deletes what is left at a later save.

    Raises:
        StorageError: the backend failed; some may still be committed.
    """
    if iterations:
        root.backend.remove_files([record_path(root, i) for i in iterations], within=root.path)


def retire_iterations(root: Location, iterations: Sequence[int]) -> None:
    """Replace the commit record of each of ``iterations`` by a retired mark, one atomic write
    each: from then on it no longer loads, but other iterations may still refer to its files
    (:func:`~dcp_fsspec.checkpoint.commit.commit_record.referable`). One without a committed record is left as it is.

    Raises:
        CorruptCheckpointError: a record is not one we wrote (that iteration is left committed).
        StorageError: the backend failed; some may still be committed.
    """
    for iteration in iterations:
        path = record_path(root, iteration)
        record = parse_record(root, path, root.backend.read_versioned(path).data)
        if record is not None:
            root.backend.write_small_atomic(path, retired_mark(record))


def remove_files(root: Location, paths: Sequence[str]) -> None:
    """Delete the files ``paths`` under ``root``, in bulk; call it on files of uncommitted or
    retired iterations only. A symbolic link is removed itself, never followed.

    Raises:
        StorageError: the backend failed; some may be left.
    """
    if paths:
        root.backend.remove_files(paths, within=root.path)


def remove_iterations(root: Location, iterations: Sequence[int]) -> None:
    """Delete every file under the folders of ``iterations``, and their unfinished uploads, in
    bulk; call it on uncommitted iterations (:func:`uncommit_iterations`). A symbolic link is
    removed itself, never followed.

    Raises:
        StorageError: the backend failed; the folders may be half deleted.
    """
    if iterations:
        root.backend.remove_trees([layout.iteration_path(root, i) for i in iterations], within=root.path)


def remove_link(root: Location, iteration: int) -> None:
    """Remove a symbolic link standing for ``iteration``'s folder, or for its commit record.

    Such a link leads elsewhere, perhaps into another run: it goes, never what it leads to,
    and the caller then writes a folder of its own. Stores without links: nothing to do.

    Raises:
        StorageError: the link could not be removed.
    """
    root.backend.remove_link(record_path(root, iteration), root.path)


def clear_folder(root: Location, iteration: int, *, keep: str) -> None:
    """Delete everything in ``iteration``'s folder but the file ``keep``, and its unfinished
    uploads; a link inside is removed, never followed.

    Raises:
        StorageError: the backend failed; the folder may be half cleared.
    """
    backend = root.backend
    folder = layout.iteration_path(root, iteration)
    backend.invalidate(folder)
    entries = [entry for entry in backend.call("ls", folder, detail=False) if entry.rstrip("/") != keep]
    backend.remove_trees(entries, within=root.path)
    backend.abort_pending_uploads(folder)
    backend.invalidate(folder)
