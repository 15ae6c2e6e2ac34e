"""``SafetensorsStorageReader``: a DCP StorageReader for a Hugging Face safetensors folder on any URL.

The folder holds ``model.safetensors.index.json`` and its shards, or one ``model.safetensors``.
Each shard's header is read with two ranged reads, and becomes DCP metadata: one chunk per
tensor. A load reads only the bytes each rank needs: a slice of whole rows is one ranged read;
any other slice reads its tensor whole, then narrows it. Every header is checked before use.
"""

from __future__ import annotations

import json
import os
import posixpath
import struct
from collections import deque
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_fsspec.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_fsspec.storage.backends.base import InPlaceFiles
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.urls import UrlBound

MiB = 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class _Stored:
    """Where one tensor's bytes are: a shard's path, the absolute offset, its dtype and shape."""

    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SafetensorsStorageReader(UrlBound, StorageReader):
    """Load a Hugging Face safetensors folder from any fsspec URL with ``dcp.load``.

    DCP calls, in order: :meth:`reset` → :meth:`read_metadata` → :meth:`set_up_storage_reader`
    → :meth:`prepare_local_plan` → :meth:`prepare_global_plan` → :meth:`read_data`.

    Args:
        path: the folder: any fsspec URL or a local path.
        storage_options: options for the fsspec filesystem.
        threads: ranged reads at once.
        window_bytes: the most bytes read ahead of the item being copied into its target.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        threads: int = 8,
        window_bytes: int = 256 * MiB,
    ) -> None:
        super().__init__()
        self._bind(path, storage_options, None, None)
        self.threads = max(1, threads)
        self.window_bytes = window_bytes
        self.storage_data: dict[MetadataIndex, _Stored] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self._rebind(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Every shard's header as DCP metadata.

        Raises:
            CheckpointNotFoundError: neither the index nor ``model.safetensors`` is there.
            CorruptCheckpointError: the index or a header is damaged; the message names the file.
        """
        state_dict_metadata: dict[str, Any] = {}
        storage_data: dict[MetadataIndex, _Stored] = {}
        for shard in self._shards():
            for name, stored in self._header(shard).items():
                zeros = torch.Size([0] * len(stored.shape))
                size = torch.Size(stored.shape)
                state_dict_metadata[name] = TensorStorageMetadata(
                    TensorProperties(dtype=stored.dtype), size, [ChunkStorageMetadata(zeros, size)]
                )
                storage_data[MetadataIndex(name, zeros)] = stored
        return Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the items concurrently, at most ``window_bytes`` ahead of the one delivered.

        A slice of whole rows whose target is contiguous and of the stored dtype is read
        straight into the target (local disk, S3); any other is read, then copied.
        """
        files = self.location.backend.in_place_files()
        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="safetensors-read") as pool:
                ahead: deque[tuple[ReadItem, torch.Tensor, ThreadFuture[torch.Tensor]]] = deque()
                in_flight = 0
                for item in plan.items:
                    stored = self.storage_data[item.storage_index]
                    target = planner.resolve_tensor(item).detach()
                    ahead.append((item, target, pool.submit(self._read, stored, item, target, files)))
                    in_flight += target.numel() * target.element_size()
                    while ahead and (in_flight > self.window_bytes or len(ahead) > 2 * self.threads):
                        in_flight -= _deliver(*ahead.popleft(), planner)
                while ahead:
                    _deliver(*ahead.popleft(), planner)
        finally:
            if files is not None:
                files.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read(
        self, stored: _Stored, item: ReadItem, target: torch.Tensor, files: InPlaceFiles | None
    ) -> torch.Tensor:
        """``item``'s slice: ``target`` itself, filled in place where it can be, else a new tensor."""
        rows = _row_range(stored, item)
        if rows is None or files is None or not target.is_contiguous() or target.dtype != stored.dtype:
            return self._read_slice(stored, item, rows)
        start, end = rows
        if end > start:
            got = files.read_into(
                stored.path, start, target.view(-1).view(torch.uint8).numpy().data.cast("B")
            )
            if got != end - start:
                raise CorruptCheckpointError(
                    f"{self.location.url_of(stored.path)} is truncated: needed bytes [{start}, {end}); restore or re-export it"
                )
        return target

    # --- internals --------------------------------------------------------------------------

    def _cat(self, path: str, start: int, end: int) -> bytes:
        url = self.location.url_of(path)
        with storage_errors("read", url):
            data: bytes = self.location.fs.cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise CorruptCheckpointError(
                f"{url} is truncated: needed bytes [{start}, {end}); restore or re-export it"
            )
        return data

    def _shards(self) -> list[str]:
        fs, folder = self.location.fs, self.location.path
        index = posixpath.join(folder, INDEX_NAME)
        with storage_errors("read", self.location.url_of(index)):
            if not fs.exists(index):
                single = posixpath.join(folder, SINGLE_NAME)
                if fs.exists(single):
                    return [single]
                raise CheckpointNotFoundError(
                    f"{self.location.url} has neither {INDEX_NAME} nor {SINGLE_NAME}; give a safetensors model folder"
                )
            raw = fs.cat_file(index)
        try:
            names = sorted(set(json.loads(raw)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{self.location.url_of(index)} is not a safetensors index ({e}); re-export it"
            ) from e
        if not all(isinstance(n, str) and n and "/" not in n and n not in (".", "..") for n in names):
            raise CorruptCheckpointError(
                f"{self.location.url_of(index)} names a shard outside its folder; re-export it"
            )
        return [posixpath.join(folder, n) for n in names]

    def _header(self, path: str) -> dict[str, _Stored]:
        url = self.location.url_of(path)
        (length,) = struct.unpack("<Q", self._cat(path, 0, 8))
        if length > _MAX_HEADER:
            raise CorruptCheckpointError(
                f"{url} claims a {length}-byte header; it is damaged or not safetensors"
            )
        try:
            header = json.loads(self._cat(path, 8, 8 + length))
            header.pop("__metadata__", None)
            stored = {name: self._entry(path, 8 + length, info) for name, info in header.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{url} has a damaged safetensors header ({e}); re-export it") from e
        return stored

    def _entry(self, path: str, data_start: int, info: dict[str, Any]) -> _Stored:
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or begin < 0 or end - begin != numel * dtype.itemsize:
            raise ValueError(f"a {list(shape)} {info['dtype']} tensor cannot take bytes [{begin}, {end})")
        return _Stored(path, data_start + begin, dtype, shape)

    def _read_slice(self, stored: _Stored, item: ReadItem, rows: tuple[int, int] | None) -> torch.Tensor:
        """The part of ``stored`` that ``item`` reads: its ``rows`` (bytes) alone, else the whole tensor narrowed."""
        if rows is not None:
            return _tensor(self._cat(stored.path, *rows), stored.dtype, tuple(item.lengths))
        nbytes = stored.dtype.itemsize
        for d in stored.shape:
            nbytes *= d
        whole = _tensor(
            self._cat(stored.path, stored.offset, stored.offset + nbytes), stored.dtype, stored.shape
        )
        for dim, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
            whole = whole.narrow(dim, o, n)
        return whole


def _row_range(stored: _Stored, item: ReadItem) -> tuple[int, int] | None:
    """The file's bytes of ``item``'s slice where it is whole rows (one range), else None."""
    offsets, lengths, shape = list(item.storage_offsets), list(item.lengths), stored.shape
    if not shape or not all(o == 0 and n == d for o, n, d in zip(offsets[1:], lengths[1:], shape[1:])):
        return None
    row = stored.dtype.itemsize
    for d in shape[1:]:
        row *= d
    start = stored.offset + offsets[0] * row
    return start, start + lengths[0] * row


def _deliver(
    item: ReadItem, target: torch.Tensor, read: ThreadFuture[torch.Tensor], planner: LoadPlanner
) -> int:
    """Commit a finished read (on the calling thread: the planner is not shared); its bytes."""
    source = read.result()
    if source is not target:
        target.copy_(source)
    planner.commit_tensor(item, target)
    return target.numel() * target.element_size()


def _tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
