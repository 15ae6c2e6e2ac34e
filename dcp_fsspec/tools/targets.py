"""What a URL given to a tool names: one DCP checkpoint, an iteration folder, or a save_dirname.

Every tool takes any of the three, so the decision is made once, here, from one listing of the
URL: a folder holding DCP's ``.metadata`` is a checkpoint; a folder named like an iteration
(``iter_000000005``) is an iteration folder of a Checkpointer; a folder holding
``latest_checkpoint.txt`` or iteration folders is a ``save_dirname`` (a "run"). A URL names a
folder: a file is refused, even one of ours (``.metadata``, a data file, ``.commit.json``, the
pointer), and the error names the folder to give instead. Anything else is a
:class:`CheckpointNotFoundError` naming the URL.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any, Literal

from dcp_fsspec.checkpoint.commit import layout, pointer
from dcp_fsspec.checkpoint.commit.commit_record import CommitRecord, read_commit_record
from dcp_fsspec.errors import CheckpointNotFoundError
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, DATA_SUFFIX, METADATA_NAME, POINTER_NAME
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.urls import Location

Kind = Literal["checkpoint", "iteration", "run"]

_WHAT_TO_GIVE = (
    f"give a DCP checkpoint folder (with .metadata), an iteration folder ({layout.format_iteration(5)}) "
    "or a Checkpointer's save_dirname"
)


@dataclass(frozen=True)
class Target:
    """A URL and what it names.

    ``location`` is the folder the tools read: the URL's, or for a file of ours its folder's.
    For an iteration folder, ``run`` is its parent (the ``save_dirname``) and ``iteration`` its
    number, which is how :mod:`dcp_fsspec.checkpoint.commit.run_listing` addresses it.
    """

    kind: Kind
    location: Location
    run: Location | None = None
    iteration: int | None = None


def parent_of(location: Location) -> Location:
    """The folder holding ``location`` (same filesystem; the URL cut at its last ``/``)."""
    url = location.url.rstrip("/")
    return Location(location.fs, posixpath.dirname(location.path), url.rsplit("/", 1)[0])


def classify(location: Location) -> Target:
    """Decide what ``location`` names, from one listing.

    Raises:
        CheckpointNotFoundError: it is none of the three (or does not exist), or it is a file.
        StorageError: the listing failed, or the URL's bucket does not exist.
    """
    entries = _listing(location)
    if _is_the_file(location, entries):
        raise CheckpointNotFoundError(_a_file(location))
    names = {posixpath.basename(e["name"].rstrip("/")): e.get("type") for e in entries}
    if METADATA_NAME in names:
        return Target("checkpoint", location)
    iteration = layout.parse_iteration(location.path)
    if iteration is not None and names:
        return Target("iteration", location, run=parent_of(location), iteration=iteration)
    if POINTER_NAME in names or any(
        layout.parse_iteration(n) is not None and kind == "directory" for n, kind in names.items()
    ):
        return Target("run", location)
    ranks = sorted(
        r
        for n, kind in names.items()
        if kind == "directory" and (r := layout.parse_rank_folder(n)) is not None
    )
    if ranks:  # a per-node local_dirname: each node's disk holds its rank's own save_dirname
        shown = ", ".join(layout.rank_folder_name(r) for r in ranks)
        raise CheckpointNotFoundError(
            f"{location.url} is a per-node local_dirname holding each rank's own save_dirname ({shown}): "
            f"give one of them, e.g. {location.url.rstrip('/')}/{layout.rank_folder_name(ranks[0])}"
        )
    what = "is empty or does not exist" if not names else "holds no .metadata, iteration folders or pointer"
    raise CheckpointNotFoundError(f"{location.url} {what}: {_WHAT_TO_GIVE}")


def _listing(location: Location) -> list[dict[str, Any]]:
    """The entries of ``location`` (the file itself, for a file); none where nothing is there.

    Raises:
        StorageError: the listing failed, or the URL's bucket does not exist.
    """
    location.fs.invalidate_cache(location.path)
    try:
        with storage_errors("list", location.url):
            return list(location.fs.ls(location.path, detail=True))
    except FileNotFoundError as e:
        location.backend.raise_if_no_container(e, location.url)
        return []


def _is_the_file(location: Location, entries: list[dict[str, Any]]) -> bool:
    """Whether the listing is ``location`` itself, a file (fsspec lists a file as itself)."""
    return (
        len(entries) == 1
        and entries[0].get("type") == "file"
        and entries[0]["name"].rstrip("/") == location.path.rstrip("/")
    )


def _a_file(file: Location) -> str:
    """Why a file is refused, and the folder to give instead where the file is one of ours."""
    name, folder = posixpath.basename(file.path), parent_of(file).url
    if name == POINTER_NAME:
        instead = (
            f"give the save_dirname that holds it, {folder} (`dcp-fsspec ls {folder}` lists its iterations)"
        )
    elif name == COMMIT_RECORD_NAME:
        instead = f"give the iteration folder that holds it, {folder}"
    elif name == METADATA_NAME or name.endswith((".metadata", DATA_SUFFIX)):
        instead = f"give the checkpoint folder that holds it, {folder}"
    else:
        instead = _WHAT_TO_GIVE
    return f"{file.url} is a file, not a folder: {instead}"


def iteration_keys(run: Location, iteration: int) -> tuple[CommitRecord | None, list[str]]:
    """An iteration's commit record and its keys: the record's, else subfolders with ``.metadata``.

    Raises:
        CorruptCheckpointError: the commit record exists but cannot be read.
        StorageError: the backend failed.
    """
    record = read_commit_record(run, iteration)
    if record is not None:
        return record, list(record.keys)
    folder = layout.iteration_path(run, iteration)
    try:
        with storage_errors("list", run.url_of(folder)):
            found = run.fs.find(folder)
    except FileNotFoundError:
        found = []
    keys = sorted(
        posixpath.basename(posixpath.dirname(p))
        for p in found
        if posixpath.basename(p) == METADATA_NAME and posixpath.dirname(posixpath.dirname(p)) == folder
    )
    return None, keys


def iteration_to_read(target: Target, verb: str) -> tuple[Location, int]:
    """The run and iteration a tool reads for a target: an iteration folder's own, or a
    save_dirname's latest (the one its pointer names).

    Args:
        target: an iteration folder or a save_dirname (not a single checkpoint).
        verb: what the tool does ("inspect", "convert"), for the error's advice.

    Raises:
        CheckpointNotFoundError: a save_dirname without a pointer.
        CorruptCheckpointError: the pointer cannot be read.
    """
    if target.kind == "iteration":
        assert target.run is not None and target.iteration is not None
        return target.run, target.iteration
    latest = pointer.read_pointer(target.location)
    if latest is None:
        raise CheckpointNotFoundError(
            f"{pointer.pointer_url(target.location)} does not exist, so {target.location.url} has no latest "
            f"checkpoint; {verb} one of its iteration folders instead (see `dcp-fsspec ls`)"
        )
    return target.location, latest


def key_location(run: Location, iteration: int, key: str) -> Location:
    """The :class:`Location` of one key (a DCP checkpoint) of an iteration."""
    path = layout.key_path(run, iteration, key)
    return Location(run.fs, path, run.url_of(path))
