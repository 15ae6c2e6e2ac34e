"""A checkpoint-shaped state dict, rebuilt bit for bit from a seed in any process.

The layout is a list of :class:`Entry` (name, shape, dtype, seed) drawn from ``random.Random``;
each tensor's values come from its own ``torch.Generator`` seed, so a load worker can rebuild
and compare one entry at a time (memory for the check is one entry, not a second state) and a
ceiling worker can lay the same bytes end to end. Values are ``randn`` / ``randint``: never
zeros, never a pattern a storage layer could compress or skip.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

KiB = 1 << 10
MiB = 1 << 20

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
# Width of the 2-D weights; rows follow from the byte size.
_COLS = 1024
# The "realistic" mix, by share of the checkpoint: ~1000 small tensors (at most 5 %), 30 % of
# the rest in medium tensors, the remainder in large ones.
_SMALL_COUNT = 1000
_SMALL_SHARE = 0.05
_MEDIUM_SHARE = 0.30


@dataclass(frozen=True)
class Entry:
    """One state-dict entry: a tensor to generate from ``seed``, or a plain Python ``value``."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    seed: int = 0
    value: Any = None

    @property
    def is_tensor(self) -> bool:
        return bool(self.dtype)

    @property
    def nbytes(self) -> int:
        if not self.is_tensor:
            return 0
        n = _DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


def realistic(size_mib: int, seed: int, prefix: str = "") -> list[Entry]:
    """A few large fp32/bf16 tensors (64–256 MiB), dozens of medium ones (1–16 MiB), up to
    1000 small ones (1–64 KiB, a quarter int64) and non-tensor entries; ``size_mib`` of
    tensor data in all (to within a few KiB)."""
    rng = random.Random(seed)
    total = size_mib * MiB
    out: list[Entry] = []

    def add(kind: str, nbytes: int, dtype: str) -> None:
        item = _DTYPES[dtype].itemsize
        if kind == "small":
            shape: tuple[int, ...] = (max(1, nbytes // item),)
        else:
            shape = (max(1, nbytes // (item * _COLS)), _COLS)
        out.append(Entry(f"{prefix}{kind}.{len(out)}.weight", shape, dtype, rng.getrandbits(62)))

    used = 0
    small_budget = int(total * _SMALL_SHARE)
    while len(out) < _SMALL_COUNT:
        n = rng.randint(1 * KiB, 64 * KiB)
        if used + n > small_budget:
            break
        dtype = rng.choice(["int64", "float32", "float32", "bfloat16"])
        add("small", n, dtype)
        used += out[-1].nbytes
    medium_budget = used + int((total - used) * _MEDIUM_SHARE)
    while medium_budget - used >= 1 * MiB:
        n = min(rng.randint(1 * MiB, 16 * MiB), medium_budget - used)
        add("medium", n, rng.choice(["float32", "bfloat16"]))
        used += out[-1].nbytes
    while total - used >= _COLS * 4:
        n = min(rng.choice([64, 128, 192, 256]) * MiB, total - used)
        add("large", n, rng.choice(["float32", "bfloat16"]))
        used += out[-1].nbytes
    return out + _non_tensors(prefix, seed)


def many_small(count: int, seed: int, prefix: str = "") -> list[Entry]:
    """``count`` small tensors (1–16 KiB: norms, biases, optimizer steps), and the
    non-tensor entries."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        dtype = rng.choice(["float32", "bfloat16", "int64"])
        numel = max(1, rng.randint(1 * KiB, 16 * KiB) // _DTYPES[dtype].itemsize)
        out.append(Entry(f"{prefix}small.{i}.weight", (numel,), dtype, rng.getrandbits(62)))
    return out + _non_tensors(prefix, seed)


def _non_tensors(prefix: str, seed: int) -> list[Entry]:
    return [
        Entry(f"{prefix}step", value=1000 + seed % 1000),
        Entry(f"{prefix}run_name", value=f"bench-{seed}"),
        Entry(f"{prefix}lr_schedule", value=[0.1, 0.01, 0.001]),
        Entry(f"{prefix}config", value={"layers": 32, "dims": [4096, 11008], "act": "silu"}),
    ]


def for_rank(size_mib: int, seed: int, *, many: int = 0, rank: int = 0, world_size: int = 1) -> list[Entry]:
    """Rank ``rank``'s share: distinct keys per rank, ``size_mib / world_size`` each."""
    prefix = f"rank{rank}." if world_size > 1 else ""
    rank_seed = seed + 7919 * rank
    if many:
        return many_small(many // world_size, rank_seed, prefix)
    return realistic(size_mib // world_size, rank_seed, prefix)


def tensor(entry: Entry) -> torch.Tensor:
    g = torch.Generator().manual_seed(entry.seed)
    dtype = _DTYPES[entry.dtype]
    if dtype.is_floating_point:
        return torch.randn(entry.shape, generator=g, dtype=dtype)
    return torch.randint(-(2**62), 2**62, entry.shape, generator=g, dtype=dtype)


def build(entries: list[Entry]) -> dict[str, Any]:
    return {e.name: tensor(e) if e.is_tensor else copy.deepcopy(e.value) for e in entries}


def template(entries: list[Entry]) -> dict[str, Any]:
    """What a loader passes to ``dcp.load``: zero-filled tensors, with their pages touched so
    the load's extra RSS is the reader's own, and non-tensor leaves set to ``None``."""
    return {
        e.name: torch.zeros(e.shape, dtype=_DTYPES[e.dtype]) if e.is_tensor else _blank(e.value)
        for e in entries
    }


def _blank(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    return None


def nbytes(entries: list[Entry]) -> int:
    return sum(e.nbytes for e in entries)


def tensor_bytes(entries: list[Entry]) -> Iterator[torch.Tensor]:
    """Every tensor's bytes (a flat uint8 view), one entry at a time."""
    for e in entries:
        if e.is_tensor:
            yield tensor(e).view(-1).view(torch.uint8)


def verify(entries: list[Entry], loaded: dict[str, Any]) -> list[str]:
    """The names of entries whose loaded value is not bit-identical (empty when all match)."""
    bad = []
    for e in entries:
        got = loaded.get(e.name)
        if e.is_tensor:
            want = tensor(e)
            same = (
                isinstance(got, torch.Tensor)
                and got.dtype == want.dtype
                and got.shape == want.shape
                and torch.equal(got.reshape(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
            )
        else:
            same = got == e.value
        if not same:
            bad.append(e.name)
    return bad
