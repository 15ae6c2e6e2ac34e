"""The tuning of our storage writer and reader, as small values that travel.

A :class:`~dcp_fsspec.checkpoint.Checkpointer` makes writers and readers in several places, one
of them a background process; passing one frozen, picklable value down from the user keeps
every one of them tuned alike. Each holds exactly the constructor keywords of its class, with
the same defaults, and gives them back with :meth:`WriterSettings.as_kwargs`.
"""

from __future__ import annotations

import dataclasses
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
        max_inflight_bytes: upload data held in memory at once across all files (S3).
        sync_files: fsync local files and folders (durability across power loss).
        checksums: store the CRC-32 of every tensor in its record, which the reader verifies.
    """

    files_per_rank: int = 8
    part_size: int = 16 * MiB
    multipart_threshold: int = 64 * MiB
    max_inflight_bytes: int = 128 * MiB
    sync_files: bool = True
    checksums: bool = True


@dataclass(frozen=True)
class ReaderSettings(_Keywords):
    """How :class:`~dcp_fsspec.storage.reader.FsspecStorageReader` reads (its tuning keywords).

    Args:
        verify_checksums: check each tensor's CRC-32 against its record, where one was stored.
        window_bytes: downloaded-but-not-yet-consumed data held at once (bounds memory).
        max_request_bytes: the largest single ranged read.
        max_gap_bytes: neighbouring reads this close are merged into one request.
        threads: concurrent reads on filesystems without an async API.
    """

    verify_checksums: bool = True
    window_bytes: int = 128 * MiB
    max_request_bytes: int = 16 * MiB
    max_gap_bytes: int = 64 * 1024
    threads: int = 16
