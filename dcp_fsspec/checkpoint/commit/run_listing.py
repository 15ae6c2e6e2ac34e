"""What is under ``save_dirname``: which iteration folders there are, and which are committed.

An iteration is *committed* when its folder holds a commit record (:mod:`~dcp_fsspec.checkpoint.commit.commit_record`) and every key
it lists is a finished DCP checkpoint (has DCP's ``.metadata``). This module reads and judges;
it never writes. One recursive listing decides for any number of folders, and an absence is
trusted only where the listing shows the folder was read. Torch-free, for the tools.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.checkpoint.commit.at_once import at_once
from dcp_fsspec.checkpoint.commit.commit_record import CommitRecord, read_commit_record
from dcp_fsspec.errors import DcpFsspecError
from dcp_fsspec.storage.format.names import COMMIT_RECORD_NAME, CONTENT_HASHES_NAME, METADATA_NAME
from dcp_fsspec.storage.transport.urls import Location

if TYPE_CHECKING:  # torch's: ls, prune and cp import this module without it
    from torch.distributed.checkpoint.metadata import Metadata


def exists(root: Location, path: str) -> bool:
    """Whether ``path`` exists; unlike ``fs.exists``, a backend failure is an error, not False.

    Treating a network error as "missing" would let retention delete a committed iteration.
    """
    root.backend.invalidate(posixpath.dirname(path))
    try:
        root.backend.call("info", path)
    except FileNotFoundError:
        return False
    return True


def folder_exists(root: Location, path: str) -> bool:
    """Whether the folder ``path`` exists (holds anything, on object stores); a backend failure
    is an error, as in :func:`exists`. One request on S3."""
    return root.backend.folder_exists(path)


def key_is_committed(root: Location, iteration: int, key: str) -> bool:
    """Whether ``key`` of ``iteration`` is a finished DCP checkpoint (has ``.metadata``)."""
    return exists(root, posixpath.join(layout.key_path(root, iteration, key), METADATA_NAME))


def _files_of(root: Location, iteration: int) -> dict[str, int]:
    """Every file under ``iteration``'s folder → its size: one recursive listing."""
    found = root.backend.find(layout.iteration_path(root, iteration))
    return {path: int(info.get("size") or 0) for path, info in found.items()}


def unfinished_keys(
    root: Location, iteration: int, keys: tuple[str, ...], listed: Collection[str] | None = None
) -> list[str]:
    """The ``keys`` of ``iteration`` that have no ``.metadata``, in one listing where possible.

    One recursive listing (``listed``, when the caller has made it) is one request on object
    stores, against one per key. fsspec's generic listing skips folders it fails to read,
    though, so each absence it reports is confirmed with a check that raises on failure: an
    error never reads as "missing".
    """
    folder = layout.iteration_path(root, iteration)
    listed = _files_of(root, iteration) if listed is None else listed
    absent = [k for k in keys if posixpath.join(folder, k, METADATA_NAME) not in listed]
    return [k for k in absent if not key_is_committed(root, iteration, k)]


@dataclass(frozen=True)
class FolderRead:
    """An iteration folder as one round trip reads it: its listing and each key's ``.metadata``.

    Attributes:
        listed: every file under the folder (one recursive listing) → its size.
        metadata: each key asked about → the bytes of its ``.metadata``, ``None`` where it has
            none (read with a call that raises on failure: an error never reads as "missing").
        parsed: each key whose ``.metadata`` the token check parsed → the result, so that a
            load that goes on to read the key does not parse it again.
    """

    listed: dict[str, int]
    metadata: dict[str, bytes | None]
    parsed: dict[str, Metadata] = field(default_factory=dict, compare=False, repr=False)

    def unfinished(self, keys: tuple[str, ...]) -> list[str]:
        """The ``keys`` that have no ``.metadata``, in order."""
        return [k for k in keys if self.metadata[k] is None]

    def sizes_in(self, folder: str) -> dict[str, int]:
        """The files directly in ``folder`` (a key's, under this one) by name → size: what a
        load's check of its data files would list again."""
        prefix = folder.rstrip("/") + "/"
        return {
            path[len(prefix) :]: size
            for path, size in self.listed.items()
            if path.startswith(prefix) and "/" not in path[len(prefix) :]
        }


def folder_reads(root: Location, iteration: int, keys: tuple[str, ...]) -> list[Callable[[], object]]:
    """The calls that read ``iteration``'s folder for ``keys``, to send with others at once
    (:func:`~dcp_fsspec.checkpoint.commit.at_once.at_once`); :func:`folder_read` makes their results a :class:`FolderRead`."""
    return [
        partial(_files_of, root, iteration),
        *(partial(_metadata_bytes, root, iteration, k) for k in keys),
    ]


def folder_read(results: list[object], keys: tuple[str, ...]) -> FolderRead:
    """The :class:`FolderRead` of :func:`folder_reads`'s results."""
    listed, *metadata = results
    assert isinstance(listed, dict)
    return FolderRead(listed, dict(zip(keys, metadata, strict=True)))  # type: ignore[arg-type]


def read_folder(root: Location, iteration: int, keys: tuple[str, ...]) -> FolderRead:
    """``iteration``'s listing and each of ``keys``' ``.metadata``, read at once."""
    return folder_read(at_once(folder_reads(root, iteration, keys), one_by_one=root.answers_locally), keys)


def _metadata_bytes(root: Location, iteration: int, key: str) -> bytes | None:
    # One GET on S3, present or not.
    return root.backend.read_versioned(
        posixpath.join(layout.key_path(root, iteration, key), METADATA_NAME)
    ).data


def inspect_iteration(
    root: Location, iteration: int, *, latest: int | None = None
) -> tuple[CommitRecord | None, str | None]:
    """``(record, None)`` if ``iteration`` is committed, else ``(None, why not)`` in words.

    Args:
        root: the ``save_dirname`` location.
        iteration: the iteration to look at.
        latest: the iteration the pointer names, if known: a folder without a record older than
            it may also be one that retention began to delete (it removes the record first).
    """
    record = read_commit_record(root, iteration)
    present = record is not None or folder_exists(root, layout.iteration_path(root, iteration))
    return judge_iteration(root, iteration, record, present, latest=latest)


def judge_iteration(
    root: Location, iteration: int, record: CommitRecord | None, present: bool, *, latest: int | None = None
) -> tuple[CommitRecord | None, str | None]:
    """:func:`inspect_iteration` from what the caller read: ``iteration``'s commit record
    (:func:`read_commit_record`) and whether its folder exists (:func:`folder_exists`), which a caller
    may read together with other things in one round trip."""
    if record is None:
        return None, _no_record(iteration, latest) if present else "does not exist"
    unfinished = unfinished_keys(root, iteration, record.keys)
    if unfinished:
        return None, lacks_metadata(root, iteration, unfinished[0])
    return record, None


def _no_record(iteration: int, latest: int | None) -> str:
    if latest is not None and iteration < latest:
        return (
            f"has no {COMMIT_RECORD_NAME}: a save that failed, or a deletion by retention that was "
            "interrupted, left it; retention deletes it at the next save"
        )
    return f"has no {COMMIT_RECORD_NAME} (its save never finished)"


def lacks_metadata(root: Location, iteration: int, key: str) -> str:
    return f"lacks {root.url_of(posixpath.join(layout.key_path(root, iteration, key), METADATA_NAME))}"


@dataclass(frozen=True)
class Listing:
    """What one recursive listing of ``save_dirname`` says about its iteration folders.

    Deciding from names costs one listing for any number of folders, against several requests
    per folder. An absence it reports is trusted only where the listing shows the folder was
    read (something is listed inside it): fsspec's generic listing skips folders it fails to
    read, and an error must never read as "not committed" (retention would delete on a guess).

    Attributes:
        folders: every iteration that has a folder, ascending.
        read: the iterations with anything listed inside their folder.
        records: the iterations whose folder lists ``.commit.json``.
        finished: ``(iteration, key)`` for each key folder that lists ``.metadata``.
        files: each iteration's files (their paths) → their sizes.
        hashed: ``(iteration, key)`` for each key folder that lists ``.content_hashes.json``.
    """

    folders: tuple[int, ...]
    read: frozenset[int]
    records: frozenset[int]
    finished: frozenset[tuple[int, str]]
    files: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    hashed: frozenset[tuple[int, str]] = frozenset()

    def size(self, iteration: int) -> int:
        """The bytes of the files listed in ``iteration``'s folder."""
        return sum(self.files.get(iteration, {}).values())

    def incremental_keys(self, iteration: int) -> list[str]:
        """The keys of ``iteration`` that list content hashes (an incremental save's): the only
        keys that refer to other iterations, or that others refer to."""
        return sorted(key for i, key in self.hashed if i == iteration)


def list_save_dirname(root: Location) -> Listing:
    """One recursive listing of ``root`` (one request per 1,000 files on S3).

    Raises:
        StorageError: the backend failed.
    """
    found = root.backend.find(root.path, withdirs=True)
    prefix = root.path.rstrip("/") + "/"
    bare: set[int] = set()
    read: set[int] = set()
    records: set[int] = set()
    finished: set[tuple[int, str]] = set()
    files: dict[int, dict[str, int]] = {}
    hashed: set[tuple[int, str]] = set()
    for name, info in found.items():
        parts = name[len(prefix) :].rstrip("/").split("/") if name.startswith(prefix) else []
        iteration = layout.parse_iteration(parts[0]) if parts else None
        if iteration is None:
            continue
        (read if len(parts) > 1 else bare).add(iteration)
        if len(parts) > 1 and info.get("type") != "directory":
            files.setdefault(iteration, {})[name] = int(info.get("size") or 0)
        if parts[1:] == [COMMIT_RECORD_NAME]:
            records.add(iteration)
        elif len(parts) == 3 and parts[2] == METADATA_NAME:
            finished.add((iteration, parts[1]))
        elif len(parts) == 3 and parts[2] == CONTENT_HASHES_NAME:
            hashed.add((iteration, parts[1]))
    # A name with nothing listed under it is an empty folder or a file of that name: only an
    # empty folder, which object stores do not have, costs a request to tell them apart.
    folders = read | {i for i in bare - read if _is_folder(root, layout.iteration_path(root, i))}
    return Listing(
        tuple(sorted(folders)),
        frozenset(read),
        frozenset(records),
        frozenset(finished),
        files,
        frozenset(hashed),
    )


def _is_folder(root: Location, path: str) -> bool:
    try:
        return bool(root.backend.call("info", path).get("type") == "directory")
    except FileNotFoundError:
        return False


def listed_record(root: Location, listing: Listing, iteration: int) -> CommitRecord | None:
    """The commit record of ``iteration`` if it is committed, deciding from ``listing``.

    Reads the record only where the listing shows one (or could not see inside the folder),
    and confirms each ``.metadata`` the listing lacks with a check that raises on failure.

    Raises:
        CorruptCheckpointError: the record is not one we wrote.
        StorageError: the backend failed.
    """
    return listed_inspection(root, listing, iteration)[0]


def listed_inspection(
    root: Location, listing: Listing, iteration: int, *, latest: int | None = None
) -> tuple[CommitRecord | None, str | None]:
    """:func:`inspect_iteration`, deciding from ``listing``: a folder the listing shows without a
    commit record costs no request; one with a record costs reading it.

    Raises:
        CorruptCheckpointError: the record is not one we wrote.
        StorageError: the backend failed.
    """
    if iteration not in listing.records and iteration in listing.read:
        return None, _no_record(iteration, latest)
    record = read_commit_record(root, iteration)
    if record is None:
        return None, _no_record(iteration, latest)
    for key in record.keys:
        if (iteration, key) not in listing.finished and not key_is_committed(root, iteration, key):
            return None, lacks_metadata(root, iteration, key)
    return record, None


def committed_iterations(root: Location) -> list[int]:
    """The committed iterations under ``root``, ascending: one listing, and one read of each
    commit record it shows (folders without one cost nothing more)."""
    listing = list_save_dirname(root)
    return [i for i in listing.folders if listed_record(root, listing, i) is not None]


@dataclass
class Survey:
    """What retention reads of ``save_dirname``, read at the start of a save beside the save's
    own requests: its listing (with the pointer and the iteration's record) and the records of
    the iterations it will keep (with the claim). Retention after the commit then costs one
    round trip, the old record's deletion, where it cost three (S3, a small save).

    Read before the save wrote, it lacks only what appeared since: folders retention then
    keeps, never deletes. A read that failed is left out, and retention reads it again.

    Attributes:
        listing: :func:`list_save_dirname`'s, or ``None`` if it failed.
        committed: iteration → whether its commit record says committed, for those read.
    """

    listing: Listing | None
    committed: dict[int, bool] = field(default_factory=dict)

    @classmethod
    def listing_read(cls, root: Location) -> Callable[[], Survey]:
        """The listing's read, to send with other questions; a failure leaves it to retention."""

        def read() -> Survey:
            try:
                return cls(list_save_dirname(root))
            except (OSError, DcpFsspecError):
                return cls(None)

        return read

    def record_reads(self, root: Location, keep_last_n: int, iteration: int) -> list[Callable[[], None]]:
        """The reads of the records retention will want once ``iteration`` is committed: the
        newest ``keep_last_n - 1`` folders below it."""
        if self.listing is None:
            return []
        listing = self.listing
        below = sorted((i for i in listing.folders if i < iteration), reverse=True)[: keep_last_n - 1]

        def read(i: int) -> None:
            try:
                self.committed[i] = listed_record(root, listing, i) is not None
            except (OSError, DcpFsspecError):
                pass  # unknown: retention reads it again, and says so if it fails there

        return [partial(read, i) for i in below]
