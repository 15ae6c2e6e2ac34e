"""How one rank's items become data files, and the writer's settings checked together.

:func:`split_into_files` balances a rank's items over at most ``files_per_rank`` files by size,
never below a size where another file only adds requests. :func:`frame_item` makes each item its
record's frame, and :func:`write_tensor_record` appends a tensor's record to an upload.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .file_syncs import FileSyncs
from .records import FramedTensor, frame_tensor
from .uploads import FileUpload

MiB = 1024 * 1024
FILES_PER_RANK = 8
# Below this much data per file, more files only add requests.
_MIN_FILE_BYTES = 32 * MiB


def checked_settings(
    files_per_rank: int, thread_count: int | None, *, file_syncs: FileSyncs | None, metadata_commits: bool,
    serialization_format: SerializationFormat,
) -> int:  # fmt: skip
    """The files written at once per rank, once the writer's settings are checked together.

    Raises:
        ValueError: ``files_per_rank`` (or ``thread_count``) below 1, both given and different,
            ``file_syncs`` with ``metadata_commits``, or a format other than ``TORCH_SAVE``.
    """
    if thread_count is not None:
        if files_per_rank not in (FILES_PER_RANK, thread_count):
            raise ValueError(
                f"thread_count={thread_count} and files_per_rank={files_per_rank} name the same "
                "setting (files written at once per rank); give one of them"
            )
        files_per_rank = thread_count
    if files_per_rank < 1:
        raise ValueError(f"files_per_rank (thread_count) must be at least 1, got {files_per_rank}")
    if file_syncs is not None and metadata_commits:
        raise ValueError("file_syncs needs metadata_commits=False: the caller commits once they are done")
    if serialization_format != SerializationFormat.TORCH_SAVE:
        raise ValueError(
            f"serialization_format={serialization_format} is not written by FsspecStorageWriter (only "
            "TORCH_SAVE, DCP's record format); use torch's HuggingFaceStorageWriter for safetensors"
        )
    return files_per_rank


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
