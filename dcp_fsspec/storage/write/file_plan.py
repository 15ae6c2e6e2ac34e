"""How one rank's items become data files, and the writer's settings checked together.

:func:`split_into_files` balances a rank's items over at most ``files_per_rank`` files by size,
never below a size where another file only adds requests. :func:`frame_item` makes each item its
record's frame, and :func:`write_tensor_record` appends a tensor's record to an upload.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_fsspec.storage.backends.uploads import FileUpload
from dcp_fsspec.storage.format.tensor_records import FramedTensor, frame_tensor
from dcp_fsspec.storage.settings import WriterSettings
from dcp_fsspec.storage.transport.file_syncs import FileSyncs

MiB = 1024 * 1024
FILES_PER_RANK = WriterSettings.files_per_rank
# Below this much data per file, more files only add requests.
_MIN_FILE_BYTES = 32 * MiB


# torch's FileSystemWriter/FsspecWriter keywords, with torch's defaults (``sync_files`` and
# ``thread_count`` default to the settings' values).
TORCH_WRITER_DEFAULTS: dict[str, Any] = {
    "overwrite": True,
    "sync_files": None,
    "thread_count": None,
    "single_file_per_rank": True,
    "per_thread_copy_ahead": 10_000_000,
    "cache_staged_state_dict": False,
    "serialization_format": SerializationFormat.TORCH_SAVE,
    "_extensions": None,
}


@dataclass(frozen=True)
class WriteContext:
    """What a caller that commits the checkpoint itself (a Checkpointer) tells the writer.

    Attributes:
        fs: the caller's filesystem, reused rather than built again from the URL.
        save_id: the save's identity in ``.metadata``, so the caller's commit can tell its own
            ``.metadata`` from another save's; ``None``: a fresh one per save.
        unique_file_names: ``save_id`` in every data file's name, so that a save sharing the
            folder with another never writes over its files.
        metadata_commits: ``.metadata`` commits the checkpoint (torch's rule): the folder is
            fsynced after the data files and after ``.metadata``. ``False`` where the caller
            commits later and fsyncs the folder itself.
        file_syncs: only with ``metadata_commits=False``: the files' fsyncs run on these
            threads, which the caller waits for before its commit.
    """

    fs: fsspec.AbstractFileSystem | None = None
    save_id: str | None = None
    unique_file_names: bool = False
    metadata_commits: bool = True
    file_syncs: FileSyncs | None = None


def with_torch_keywords(settings: WriterSettings, torch_keywords: dict[str, Any]) -> WriterSettings:
    """``settings`` with torch's ``sync_files`` and ``thread_count`` applied, where given.

    Raises:
        ValueError: ``thread_count`` below 1, or different from a ``files_per_rank`` set apart
            from the default.
    """
    changes: dict[str, Any] = {}
    if torch_keywords["sync_files"] is not None:
        changes["sync_files"] = torch_keywords["sync_files"]
    thread_count = torch_keywords["thread_count"]
    if thread_count is not None:
        if settings.files_per_rank not in (FILES_PER_RANK, thread_count):
            raise ValueError(
                f"thread_count={thread_count} and files_per_rank={settings.files_per_rank} name the "
                "same setting (files written at once per rank); give one of them"
            )
        if thread_count < 1:
            raise ValueError(f"thread_count must be at least 1, got {thread_count}")
        changes["files_per_rank"] = thread_count
    return dataclasses.replace(settings, **changes) if changes else settings


def check_context(context: WriteContext, serialization_format: SerializationFormat) -> None:
    """Refuse what the writer cannot do.

    Raises:
        ValueError: ``file_syncs`` with ``metadata_commits``, or a format other than ``TORCH_SAVE``.
    """
    if context.file_syncs is not None and context.metadata_commits:
        raise ValueError("file_syncs needs metadata_commits=False: the caller commits once they are done")
    if serialization_format != SerializationFormat.TORCH_SAVE:
        raise ValueError(
            f"serialization_format={serialization_format} is not written by FsspecStorageWriter (only "
            "TORCH_SAVE, DCP's record format); use torch's HuggingFaceStorageWriter for safetensors"
        )


def item_nbytes(item: WriteItem) -> int:
    """The bytes of an item's tensor data (0 for an object's bytes, unknown before it is pickled)."""
    if item.tensor_data is None:
        return 0
    numel = 1
    for s in item.tensor_data.size:
        numel *= s
    return numel * item.tensor_data.properties.dtype.itemsize


def split_into_files(items: list[WriteItem], max_files: int) -> list[list[WriteItem]]:
    """Balance items over files by size (largest first into the lightest file)."""
    total = sum(item_nbytes(i) for i in items)
    n = max(1, min(max_files, total // _MIN_FILE_BYTES, len(items)))
    bins: list[list[WriteItem]] = [[] for _ in range(n)]
    sizes = [0] * n
    for item in sorted(items, key=item_nbytes, reverse=True):
        k = sizes.index(min(sizes))
        bins[k].append(item)
        sizes[k] += item_nbytes(item) or 1
    return [b for b in bins if b]


def frame_item(item: WriteItem, data: Any) -> FramedTensor | None:
    """The tensor record of a tensor item (``None`` for an object's bytes), its type checked.

    Raises:
        TypeError: DCP resolved the item to something else than its type says.
    """
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(f"DCP resolved BYTE_IO item {item.index.fqn!r} to {type(data).__name__}")
        return None
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"DCP resolved tensor item {item.index.fqn!r} to {type(data).__name__}")
    return frame_tensor(data)


def write_tensor_record(upload: FileUpload, record: FramedTensor, *, checksum: bool) -> None:
    """Append a tensor's record to ``upload``. Its CRC-32 comes from the upload, which computes
    it in the pass it makes over the bytes anyway (S3 checksums every request body)."""
    upload.write([record.header])
    crc = 0
    if checksum and len(record.data):
        crc = upload.write_checksummed(record.data)
    elif len(record.data):
        upload.write([record.data])
    upload.write([record.trailer(crc)])
