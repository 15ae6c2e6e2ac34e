""".metadata: read once, unpickled with an allow-list, and checked before anything it names is read.

:func:`read_metadata` is the one place ``.metadata`` is unpickled (with :mod:`~dcp_fsspec.storage.format.safe_entries`'s
allow-list) and checked: every entry inside the checkpoint folder or a reference of an allowed
shape (:mod:`~dcp_fsspec.storage.format.references`), at a real offset and length, every tensor's chunks within its shape.
Loads, verification, copies and the tools all read it through here.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, overload

from dcp_fsspec.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_fsspec.storage.format import metadata_standins
from dcp_fsspec.storage.format.metadata_unpickler import unpickle_metadata
from dcp_fsspec.storage.format.names import metadata_name, relative_path_problem
from dcp_fsspec.storage.format.references import is_reference, reference_problem
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.urls import Location

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata


@dataclass(frozen=True)
class _Classes:
    """The classes a parsed ``.metadata`` is checked against: torch's, or their stand-ins."""

    metadata: type
    tensor: type
    bytes: type
    chunk: type
    properties: tuple[type, ...]
    index: type
    storage_info: type
    storage_meta: type
    dtype: type


_STAND_IN_CLASSES = _Classes(
    metadata_standins.Metadata,
    metadata_standins.TensorStorageMetadata,
    metadata_standins.BytesStorageMetadata,
    metadata_standins.ChunkStorageMetadata,
    (metadata_standins.TensorProperties,),
    metadata_standins.MetadataIndex,
    metadata_standins.StorageInfo,
    metadata_standins.StorageMeta,
    metadata_standins.DType,
)


@functools.cache
def _torch_classes() -> _Classes:
    import torch
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as LegacyTensorProperties
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    # Older DCP metadata pickled the sharded-tensor module's TensorProperties (same fields);
    # torch still loads it (its test_compatibility.py::test_sharded_tensor_dependency).
    return _Classes(
        metadata.Metadata,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        (metadata.TensorProperties, LegacyTensorProperties),
        metadata.MetadataIndex,
        _StorageInfo,
        metadata.StorageMeta,
        torch.dtype,
    )


def _classes_of(metadata: object) -> _Classes:
    return _STAND_IN_CLASSES if isinstance(metadata, metadata_standins.Metadata) else _torch_classes()


def metadata_url(location: Location, rank: int | None = None) -> str:
    """The URL of the ``.metadata`` (or ``__{rank}.metadata``) of the checkpoint at ``location``."""
    return location.url_of(location.join(metadata_name(rank)))


@overload
def read_metadata(
    location: Location,
    rank: int | None = None,
    *,
    trust_checkpoint: bool = False,
    extents: bool = True,
    max_entries: int | None = None,
    references: bool = False,
    stand_ins: Literal[False] = False,
) -> Metadata: ...


@overload
def read_metadata(
    location: Location,
    rank: int | None = None,
    *,
    trust_checkpoint: bool = False,
    extents: bool = True,
    max_entries: int | None = None,
    references: bool = False,
    stand_ins: Literal[True],
) -> metadata_standins.Metadata: ...


def read_metadata(
    location: Location,
    rank: int | None = None,
    *,
    trust_checkpoint: bool = False,
    extents: bool = True,
    max_entries: int | None = None,
    references: bool = False,
    stand_ins: bool = False,
) -> Any:
    """Read, unpickle and check the ``.metadata`` of the DCP checkpoint at ``location``.

    Args:
        location: the checkpoint folder.
        rank: read ``__{rank}.metadata`` instead (saves made without collectives).
        trust_checkpoint: unpickle any class it names (see :func:`parse_metadata`).
        extents: check each record's offset and length too (see :func:`check_metadata`).
        max_entries: refuse it past this many entries or records (see :func:`parse_metadata`).
        references: allow references to sibling checkpoints (see :func:`check_metadata`).
        stand_ins: return :mod:`~dcp_fsspec.storage.format.metadata_standins`' classes, not torch's: for tools that only
            read what it says, without importing torch.

    Raises:
        CheckpointNotFoundError: there is no ``.metadata``: no committed checkpoint here.
        CorruptCheckpointError: it is not DCP metadata, or names a class outside the allow-list
            (see :func:`parse_metadata`).
        UsageError: it holds more than ``max_entries`` entries or records.
        StorageError: the backend failed.
    """
    path = location.join(metadata_name(rank))
    url = metadata_url(location, rank)
    try:
        with storage_errors("read", repr(url)):
            raw = location.retry.run(location.fs, "cat_file", path, url=url)
    except FileNotFoundError as e:
        why = (
            "its bucket does not exist; create the bucket or fix the URL"
            if location.backend.container_missing(e)
            else f"{url!r} does not exist (the save never finished, or the URL is wrong)"
        )
        raise CheckpointNotFoundError(f"no checkpoint at {location.url!r}: {why}") from e
    return parse_metadata(
        raw,
        url,
        trust_checkpoint=trust_checkpoint,
        extents=extents,
        max_entries=max_entries,
        references=references,
        stand_ins=stand_ins,
    )


@overload
def parse_metadata(
    raw: bytes,
    url: str,
    *,
    trust_checkpoint: bool = False,
    extents: bool = True,
    max_entries: int | None = None,
    references: bool = False,
    stand_ins: Literal[False] = False,
) -> Metadata: ...


@overload
def parse_metadata(
    raw: bytes,
    url: str,
    *,
    trust_checkpoint: bool = False,
    extents: bool = True,
    max_entries: int | None = None,
    references: bool = False,
    stand_ins: Literal[True],
) -> metadata_standins.Metadata: ...


def parse_metadata(
    raw: bytes,
    url: str,
    *,
    trust_checkpoint: bool = False,
    extents: bool = True,
    max_entries: int | None = None,
    references: bool = False,
    stand_ins: bool = False,
) -> Any:
    """Unpickle ``.metadata``'s bytes, read from ``url`` (named in errors), and check what they say.

    Unless ``trust_checkpoint``, only the classes DCP metadata consists of are unpickled
    (:func:`~dcp_fsspec.storage.format.metadata_unpickler.unpickle_metadata`): a crafted file cannot run code. Either way, every entry
    is checked before any data file is opened (:func:`check_metadata`): a storage entry names a
    file inside the checkpoint folder, at an offset >= 0, with a length > 0.

    The whole file is parsed into memory. ``max_entries`` bounds that: past that many state-dict
    entries, or that many records, the parse stops.

    Raises:
        CorruptCheckpointError: the bytes do not unpickle, name a class outside the allow-list,
            or hold something else than well-formed DCP ``Metadata``.
        UsageError: it holds more than ``max_entries`` entries or records.
    """
    metadata = unpickle_metadata(
        raw, url, trust_checkpoint=trust_checkpoint, max_entries=max_entries, stand_ins=stand_ins
    )
    expected = _STAND_IN_CLASSES.metadata if stand_ins else _torch_classes().metadata
    if not isinstance(metadata, expected):
        raise CorruptCheckpointError(f"{url!r} does not hold DCP metadata (found {type(metadata).__name__})")
    check_metadata(metadata, url, extents=extents, references=references)
    return metadata


def check_metadata(metadata: Any, url: str, *, extents: bool = True, references: bool = False) -> None:
    """Check that ``metadata`` (from ``url``) is shaped as DCP writes it, so that nothing reading it
    fails later with a misleading error, reads outside the checkpoint folder, or reads nothing.

    Args:
        extents: check that each record lies at an offset >= 0 and has a length > 0. Without
            it, :func:`extent_error` checks that later.
        references: a data file may also be a sibling checkpoint's (``../step-10/…``); another
            iteration's same key (``../../iter_N/key/…``) always may (see :mod:`~dcp_fsspec.storage.format.references`).

    Raises:
        CorruptCheckpointError: naming the entry and what is wrong with it.
    """
    classes = _classes_of(metadata)

    def bad(entry: object, what: str) -> CorruptCheckpointError:
        return _corrupt(url, entry, what)

    _check_entries(metadata.state_dict_metadata, classes, bad)
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, classes.storage_meta):
        raise bad("storage_meta", f"is a {type(metadata.storage_meta).__name__}, not DCP's StorageMeta")
    storage = metadata.storage_data
    if storage is None:
        return  # the reader and verification say so, naming what they need it for
    if not isinstance(storage, dict):
        raise bad("storage_data", f"is a {type(storage).__name__}, not a dict")
    checked_paths: set[str] = set()
    for index, info in storage.items():
        if not isinstance(index, classes.index) or not isinstance(index.fqn, str):
            raise bad(getattr(index, "fqn", index), "has a storage key that is not a MetadataIndex")
        if not isinstance(info, classes.storage_info):
            raise bad(index.fqn, f"has storage info of type {type(info).__name__}")
        if info.relative_path not in checked_paths:
            problem = _stored_path_problem(info.relative_path, url, references)
            if problem is not None:
                raise bad(
                    index.fqn,
                    f"names the data file {info.relative_path!r}, which is outside the checkpoint folder: "
                    f"{problem}",
                )
            checked_paths.add(info.relative_path)
        problem = (_extent_problem(info) if extents else None) or _descriptors_problem(info)
        if problem is not None:
            raise bad(index.fqn, problem)


def _check_entries(entries: Any, classes: Any, bad: Callable[[object, str], CorruptCheckpointError]) -> None:
    """Each entry of ``state_dict_metadata`` is named by a string and described as DCP does."""
    if not isinstance(entries, dict):
        raise bad("state_dict_metadata", f"is a {type(entries).__name__}, not a dict")
    for fqn, meta in entries.items():
        if not isinstance(fqn, str):
            raise bad(fqn, "is not named by a string")
        if isinstance(meta, classes.tensor):
            _check_tensor(fqn, meta, classes, bad)
        elif not isinstance(meta, classes.bytes):
            raise bad(fqn, f"is described by a {type(meta).__name__}, not a tensor's or an object's metadata")


def _descriptors_problem(info: Any) -> str | None:
    """Why a record's transform descriptors are not a list of strings; None if they are (or absent)."""
    descriptors = info.transform_descriptors
    if descriptors is None:
        return None
    if isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors):
        return None
    return f"has transform descriptors {descriptors!r}, not a list of strings"


def _stored_path_problem(path: object, metadata_url: str, siblings: bool) -> str | None:
    """Why a data file named in the ``.metadata`` at ``metadata_url`` may not be read; None if it may.

    Inside the checkpoint folder, or a reference of an allowed shape (:mod:`~dcp_fsspec.storage.format.references`).
    """
    if isinstance(path, str) and is_reference(path):
        return reference_problem(path, posixpath.dirname(metadata_url), siblings=siblings)
    return relative_path_problem(path)


def extent_error(metadata: Any, url: str) -> CorruptCheckpointError | None:
    """The error for the first record of ``metadata`` (from ``url``, checked by
    :func:`check_metadata` without ``extents``) at a negative offset or of no length, else None."""
    for index, info in (metadata.storage_data or {}).items():
        problem = _extent_problem(info)
        if problem is not None:
            return _corrupt(url, index.fqn, problem)
    return None


def _extent_problem(info: _StorageInfo) -> str | None:
    """What is wrong with where a record lies, or None."""
    if not _is_int(info.offset) or info.offset < 0:
        return f"is stored at offset {info.offset!r} of {info.relative_path!r}; an offset must be an int >= 0"
    if not _is_int(info.length) or info.length <= 0:
        return f"is stored as {info.length!r} bytes of {info.relative_path!r}; a record is at least 1 byte"
    return None


def _corrupt(url: str, entry: object, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url!r} is corrupt: entry {entry!r} {what}; restore it or load another checkpoint"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tensor(
    fqn: str,
    meta: TensorStorageMetadata,
    classes: _Classes,
    bad: Callable[[object, str], CorruptCheckpointError],
) -> None:
    properties = getattr(meta, "properties", None)
    if not isinstance(properties, classes.properties) or not isinstance(
        getattr(properties, "dtype", None), classes.dtype
    ):
        raise bad(fqn, "has no tensor dtype")
    size = getattr(meta, "size", None)
    if not _is_shape(size):
        raise bad(fqn, f"has the shape {size!r}, not a tuple of ints >= 0")
    chunks = getattr(meta, "chunks", None)
    if not isinstance(chunks, list):
        raise bad(fqn, f"has chunks {chunks!r}, not a list")
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if (
            not isinstance(chunk, classes.chunk)
            or not _is_shape(offsets)
            or not _is_shape(sizes)
            or not len(offsets) == len(sizes) == len(size)
            or any(o + s > whole for o, s, whole in zip(offsets, sizes, size))
        ):
            raise bad(
                fqn,
                f"has a chunk at {offsets!r} of {sizes!r} that does not lie within its shape {tuple(size)}",
            )


def _is_shape(value: object) -> TypeGuard[tuple[int, ...]]:
    return isinstance(value, tuple) and all(_is_int(v) and v >= 0 for v in value)
