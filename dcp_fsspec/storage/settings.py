"""The tuning of our storage writer and reader, as small values that travel.

The writer and the reader each take one settings value. A
:class:`~dcp_fsspec.checkpoint.Checkpointer` makes writers and readers in several places, one of
them a background process; one frozen, picklable value passed down keeps them all tuned alike.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MiB = 1024 * 1024


@dataclass(frozen=True)
class WriterSettings:
    """How :class:`~dcp_fsspec.storage.write.writer.FsspecStorageWriter` writes: its ``settings``.

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
            ValueError: ``files_per_rank`` below 1, an unknown compression, or a level without one.
            MissingDriverError: ``"zstd"`` without the ``zstandard`` package.
        """
        if self.files_per_rank < 1:
            raise ValueError(f"files_per_rank must be at least 1, got {self.files_per_rank}")
        if self.compression is not None or self.compression_level is not None:
            from dcp_fsspec.storage.format.transforms import (
                compression_extensions,
            )  # torch: only for those who compress

            compression_extensions(self.compression, self.compression_level)


@dataclass(frozen=True)
class ReaderSettings:
    """How :class:`~dcp_fsspec.storage.read.reader.FsspecStorageReader` reads: its ``settings``.

    Args:
        verify_checksums: check each tensor's CRC-32 against its record, where one was stored.
        window_bytes: downloaded-but-not-yet-consumed data held at once (bounds memory).
        max_request_bytes: the largest single ranged read.
        max_gap_bytes: neighbouring reads this close are merged into one request.
        threads: concurrent reads on filesystems without an async API.
        cooperative: when several ranks load with ``dcp.load``, each record several of them need
            is read from storage by one and broadcast to the others over the reader's
            ``process_group``; ``.metadata`` and the listing of the data files are read by rank 0
            and broadcast.
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


def split_keywords(
    owner: str,
    settings_class: type,
    torch_defaults: Mapping[str, Any],
    storage_options: dict[str, Any] | None,
    keywords: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """torch's keywords and the storage options, out of a constructor's ``**keywords``.

    torch's ``FsspecWriter`` and ``FsspecReader`` pass every keyword they do not know to the
    fsspec filesystem. Ours do the same, after taking out torch's own names (filled with torch's
    defaults). A name of our settings, or one that looks like a misspelt name, would otherwise
    vanish into the filesystem, so it is refused.

    Returns:
        torch's keywords, every one of ``torch_defaults`` present; the merged storage options.

    Raises:
        TypeError: a field of ``settings_class`` given as a keyword, or a misspelt name.
        ValueError: a storage option given both in ``storage_options`` and as a keyword.
    """
    fields = [field.name for field in dataclasses.fields(settings_class)]
    torch_keywords = dict(torch_defaults)
    storage_kwargs = {}
    for name, value in keywords.items():
        if name in torch_defaults:
            torch_keywords[name] = value
        elif name in fields:
            raise TypeError(
                f"{owner}() takes {name!r} in its settings: pass "
                f"settings={settings_class.__name__}({name}={value!r})"
            )
        else:
            close = difflib.get_close_matches(name, [*torch_defaults, *fields], n=1, cutoff=0.8)
            if close:
                raise TypeError(
                    f"{owner}() got an unexpected keyword argument {name!r}: did you mean {close[0]!r}? "
                    "(other keywords are passed to the fsspec filesystem as storage options)"
                )
            storage_kwargs[name] = value
    both = sorted(set(storage_kwargs) & set(storage_options or {}))
    if both:
        raise ValueError(
            f"{owner}(): storage option(s) {both} given both in storage_options and as keywords; give each once"
        )
    merged = {**(storage_options or {}), **storage_kwargs} if storage_kwargs else storage_options
    return torch_keywords, merged
