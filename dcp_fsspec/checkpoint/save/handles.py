"""Staged tensors cross the pipe to the background process once; later saves send a token.

A staged tensor lives in shared memory, and pickling it for the pipe shares its segment (a file
descriptor and a lookup on the other side) per tensor: for a state of many tensors, a large
part of what an asynchronous save blocks once its buffers exist. The staging
buffers are reused from save to save, so the background process keeps the ones it received and
each later save names them by token.

Identity is the buffer object itself, checked through a weak reference (an ``id`` alone could
be reused by a new buffer after an old one was freed). Each save also lists the tokens it uses,
and the receiver forgets the others, so buffers the stager released are unmapped there too.
Containers are walked with torch's pytree; DTensors and anything else cross as before.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class _New:
    token: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class _Known:
    token: int


class HandleSender:
    """The training side: replaces tensors the receiver already has by their token."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._next_token = 0

    def pack(self, staged: Any) -> tuple[Any, list[int]]:
        """``staged`` with its shared tensors replaced by tokens, and every token it uses."""
        self._sent = {k: v for k, v in self._sent.items() if v[0]() is not None}
        used: list[int] = []
        return tree_map(lambda value: self._pack(value, used), staged), used

    def _pack(self, value: Any, used: list[int]) -> Any:
        if type(value) is not torch.Tensor or not value.is_shared():
            return value
        known = self._sent.get(id(value))
        if known is not None and known[0]() is value:
            used.append(known[1])
            return _Known(known[1])
        token = self._next_token
        self._next_token += 1
        self._sent[id(value)] = (weakref.ref(value), token)
        used.append(token)
        return _New(token, value)


class HandleReceiver:
    """The background side: keeps received tensors by token and puts them back in place."""

    def __init__(self) -> None:
        self._tensors: dict[int, torch.Tensor] = {}

    def unpack(self, packed: Any, used: list[int]) -> Any:
        staged = tree_map(self._unpack, packed)
        keep = set(used)
        self._tensors = {t: v for t, v in self._tensors.items() if t in keep}
        return staged

    def keep(self, packed: Any) -> None:
        """Keep tensors sent ahead of the save that first uses them."""
        tree_map(self._unpack, packed)

    def _unpack(self, value: Any) -> Any:
        if isinstance(value, _New):
            self._tensors[value.token] = value.tensor
            return value.tensor
        if isinstance(value, _Known):
            return self._tensors[value.token]
        return value
