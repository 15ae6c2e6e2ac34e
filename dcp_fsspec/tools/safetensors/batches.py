"""The tensors of one safetensors shard: its header, and its tensors read a batch at a time.

A batch is views of one buffer: each tensor read in its stored dtype, then cast into the
output dtype where the export asks for another. :mod:`~dcp_fsspec.tools.safetensors.pieces` streams a tensor
larger than the buffer; every other tensor comes through :func:`read_batch`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from dcp_fsspec.errors import UsageError
from dcp_fsspec.storage.read.reader import FsspecStorageReader

MiB = 1024 * 1024
_ALIGN = 64  # each tensor's offset in a batch's buffer
_ALWAYS_MAPPED = 33 * MiB  # above glibc's largest mmap threshold (32 MiB)
_CAST_PIECE = (
    1 << 20
)  # elements cast and checked at once: isinf of a half-precision piece makes a float32 copy

# The safetensors name of each dtype the format holds.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class Entry:
    """One tensor to export: its name in the checkpoint and in the output."""

    fqn: str
    name: str
    shape: tuple[int, ...]
    source_dtype: torch.dtype
    dtype: torch.dtype

    @property
    def source_bytes(self) -> int:
        return numel(self.shape) * self.source_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def header(shard: list[Entry]) -> bytes:
    """The shard's length-prefixed JSON header, padded to 8 bytes as safetensors writes it."""
    fields: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in shard:
        fields[e.name] = {
            "dtype": DTYPE_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def batches(shard: list[Entry], buffer_bytes: int) -> Iterator[list[Entry]]:
    """``shard``'s tensors in order, grouped into batches of at most ``buffer_bytes`` (a bigger tensor alone)."""
    batch: list[Entry] = []
    size = 0
    for entry in shard:
        if batch and size + entry.source_bytes > buffer_bytes:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry.source_bytes
    if batch:
        yield batch


def read_batch(
    reader: FsspecStorageReader, metadata: Metadata, batch: list[Entry], url: str
) -> list[torch.Tensor]:
    """Load ``batch``'s tensors, and only those, with DCP's planner and our ranged reader.

    Returns them in the output dtype, all views of one buffer.
    """
    sources, outputs = carve(batch)
    state_dict = {e.fqn: t for e, t in zip(batch, sources)}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = planner.finish_plan(reader.prepare_global_plan(planner.create_global_plan([plan]))[0])
    reader.read_data(plan, planner).wait()
    for entry, source, output in zip(batch, sources, outputs):
        if output is not source:
            cast_into(entry, source, output, url)
    return outputs


def carve(batch: list[Entry]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each entry's source tensor and output tensor (the same where the dtype stays), in one buffer.

    One allocation per batch, of at least :data:`_ALWAYS_MAPPED` bytes: glibc maps those and
    unmaps them on free. Many smaller ones in turn fragment its heap, and the RSS creeps up
    toward the model's size.
    """
    places: list[tuple[int, torch.dtype, tuple[int, ...]]] = []
    end = 0
    for e in batch:
        for dtype in (e.source_dtype, e.dtype) if e.dtype != e.source_dtype else (e.source_dtype,):
            places.append((end, dtype, e.shape))
            end += -(-numel(e.shape) * dtype.itemsize // _ALIGN) * _ALIGN
    # Zeroed where used: a crafted .metadata whose chunks leave a gap exports zeros there, not
    # our memory. The rest of the mapping is never touched, so its pages are never faulted in.
    flat = torch.empty(max(end, _ALWAYS_MAPPED), dtype=torch.uint8)[:end]
    flat.zero_()
    views = iter([flat[o : o + numel(shape) * d.itemsize].view(d).view(shape) for o, d, shape in places])
    sources, outputs = [], []
    for e in batch:
        sources.append(next(views))
        outputs.append(next(views) if e.dtype != e.source_dtype else sources[-1])
    return sources, outputs


def cast_into(entry: Entry, source: torch.Tensor, output: torch.Tensor, url: str) -> None:
    """Copy ``source`` into ``output``'s dtype, refused where a finite value would become infinite."""
    # A piece at a time: the check's masks stay small, whatever the tensor's size.
    sources, outputs = source.reshape(-1).split(_CAST_PIECE), output.view(-1).split(_CAST_PIECE)
    if any(_overflows(s, o) for s, o in zip(sources, outputs)):
        raise UsageError(
            f"writing {url}: {entry.fqn!r} holds values beyond {entry.dtype}'s range; "
            "export it in a wider dtype (--dtype float32 or bfloat16)"
        )


def _overflows(source: torch.Tensor, output: torch.Tensor) -> bool:
    output.copy_(source)
    # Most pieces have no infinity at all: one pass tells, and the exact check runs on the rest.
    return bool(torch.isinf(output).any()) and bool((torch.isinf(output) & torch.isfinite(source)).any())
