"""Staged tensors cross to the background process once; later saves name them by token."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing

from dcp_fsspec.checkpoint.save.handles import HandleReceiver, HandleSender


def _shared(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32).share_memory_()


def _cross(obj: object) -> object:
    """What the pipe does: pickle with torch's shared-memory reductions, unpickle."""
    return pickle.loads(bytes(ForkingPickler.dumps(obj)))


def test_a_reused_buffer_crosses_once_and_keeps_its_place_and_values() -> None:
    sender, receiver = HandleSender(), HandleReceiver()
    a, b = _shared(4), _shared(3)
    staged = {"model": OrderedDict(w=a, nested=[b, (a, 7)]), "trainer": {"step": 1}}
    packed, used = sender.pack(staged)
    first = receiver.unpack(_cross(packed), used)
    assert isinstance(first["model"], OrderedDict) and first["trainer"] == {"step": 1}
    assert torch.equal(first["model"]["w"], a) and torch.equal(first["model"]["nested"][0], b)

    a.add_(100)  # the next save's staging writes into the same buffers
    packed, used = sender.pack(staged)
    assert "_New" not in repr(packed)  # nothing crosses again
    second = receiver.unpack(_cross(packed), used)
    assert second["model"]["w"] is first["model"]["w"]
    assert torch.equal(second["model"]["nested"][1][0], a)  # sees the new values
    assert second["model"]["nested"][1][1] == 7


def test_released_buffers_are_forgotten_and_a_new_buffer_is_never_mistaken_for_one() -> None:
    sender, receiver = HandleSender(), HandleReceiver()
    old = _shared(5)
    packed, used = sender.pack({"k": old})
    receiver.unpack(_cross(packed), used)
    del old  # the stager released it; a new buffer may get the same id()
    new = torch.full((5,), 9.0).share_memory_()
    packed, used = sender.pack({"k": new})
    got = receiver.unpack(_cross(packed), used)
    assert torch.equal(got["k"], new)
    assert len(receiver._tensors) == 1


def test_tensors_outside_shared_memory_and_other_values_cross_as_they_are() -> None:
    sender = HandleSender()
    plain = torch.ones(2)
    packed, used = sender.pack({"t": plain, "s": "x"})
    assert packed["t"] is plain and packed["s"] == "x" and used == []
