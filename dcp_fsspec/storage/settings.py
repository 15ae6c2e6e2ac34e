"""The tuning of our storage writer and reader, as small values that travel.

A :class:`~dcp_fsspec.checkpoint.Checkpointer` makes writers and readers in several places, one
of them a background process; passing one frozen, picklable value down from the user keeps
every one of them tuned alike. Each holds exactly the constructor keywords of its class, with
the same defaults, and gives them back with :meth:`WriterSettings.as_kwargs`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MiB = 1024 * 1024


@dataclass(frozen=True)
class _Keywords:
    """Shared by the settings dataclasses: their fields, as constructor keywords."""

    def as_kwargs(self) -> dict[str, Any]:
        """The fields by name, to pass as ``**keywords`` to the writer's or reader's constructor."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@dataclass(frozen=True)
class WriterSettings(_Keywords):
    """How :class:`~dcp_fsspec.storage.writer.FsspecStorageWriter` writes (its tuning keywords).

    Args:
        files_per_rank: at most this many data files per rank, written concurrently.
        part_size: multipart upload part size on object stores, in bytes.
        multipart_threshold: on S3, a data file up to this many bytes goes up in one PUT.
        max_inflight_bytes: request bytes in flight at once across all files (S3; bodies are
            views of the tensors' memory, not copies).
        sync_files: fsync local files and folders (durability across power loss).
        checksums: store the CRC-32 of every tensor in its record, which the reader verifies.
        compression: ``"zstd"`` compresses every record with torch's ``ZStandard`` format
            (torch's readers load it); ``None`` stores them as they are.
        compression_level: the zstd level (1–22, negative: faster; default 3); only with ``compression``.
    """

    files_per_rank: int = 8
    part_size: int = 16 * MiB
    multipart_threshold: int = 64 * MiB
    max_inflight_bytes: int = 128 * MiB
    sync_files: bool = True
    checksums: bool = True
    compression: str | None = None
    compression_level: int | None = None

    def __post_init__(self) -> None:
        """Check the compression now, not at the first save.

        Raises:
            ValueError: an unknown compression, or a level without one.
            MissingDriverError: ``"zstd"`` without the ``zstandard`` package.
        """
        if self.compression is not None or self.compression_level is not None:
            from .transforms import compression_extensions  # torch: only for those who compress

            compression_extensions(self.compression, self.compression_level)


@dataclass(frozen=True)
class ReaderSettings(_Keywords):
    """How :class:`~dcp_fsspec.storage.reader.FsspecStorageReader` reads (its tuning keywords).

    Args:
        verify_checksums: check each tensor's CRC-32 against its record, where one was stored.
        window_bytes: downloaded-but-not-yet-consumed data held at once (bounds memory).
        max_request_bytes: the largest single ranged read.
        max_gap_bytes: neighbouring reads this close are merged into one request.
        threads: concurrent reads on filesystems without an async API.
        cooperative: when several ranks load, each record several of them need is read from
            storage by one and broadcast to the others (see the reader's ``cooperative``).
            ``None``: on in :meth:`Checkpointer.load <dcp_fsspec.Checkpointer.load>`, off in a
            plain reader; ``False`` turns it off there too.
        trust_checkpoint: what is read was written by you: unpickle ``.metadata`` and
            non-tensor entries in full, whatever classes they name, which runs any code they
            hold. By default only DCP metadata's classes, and for non-tensor entries what
            ``torch.load(weights_only=True)`` constructs, are loaded; anything else is a
            ``CorruptCheckpointError`` naming it. In a :class:`Checkpointer
            <dcp_fsspec.Checkpointer>` it also governs the load planner and the resume checks.
    """

    verify_checksums: bool = True
    window_bytes: int = 128 * MiB
    max_request_bytes: int = 16 * MiB
    max_gap_bytes: int = 64 * 1024
    threads: int = 16
    cooperative: bool | None = None
    trust_checkpoint: bool = False


def merge_storage_kwargs(
    constructor: Callable[..., Any], storage_options: dict[str, Any] | None, storage_kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """``storage_options`` plus torch-``FsspecWriter``-style ``**storage_kwargs``, as one dict.

    Those keywords go to the fsspec filesystem, which takes (and may ignore) any name, so a
    misspelt keyword of the ``constructor``'s own (``file_per_rank=``) would otherwise vanish there.

    Raises:
        TypeError: a storage keyword that looks like a misspelling of one of the constructor's.
        ValueError: a storage option given both ways.
    """
    if not storage_kwargs:
        return storage_options
    owner = constructor.__qualname__.split(".")[0]
    known = list(inspect.signature(constructor).parameters)
    for name in storage_kwargs:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if close:
            raise TypeError(
                f"{owner}() got an unexpected keyword argument {name!r}: did you mean {close[0]!r}? "
                "(other keywords are passed to the fsspec filesystem as storage options)"
            )
    both = sorted(set(storage_kwargs) & set(storage_options or {}))
    if both:
        raise ValueError(f"{owner}(): storage option(s) {both} given both in storage_options and as keywords; give each once")
    return {**(storage_options or {}), **storage_kwargs}
