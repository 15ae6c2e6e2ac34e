"""Control messages between ranks: what they return, and what they leave in the group's threads.

A gloo worker thread that still holds a message's tensor when the collective returns frees it
later, and freeing it takes the GIL. A program that then drops its DDP model after
``destroy_process_group`` joins those threads while holding the GIL, and hangs at exit. So every
method returns only once the group has let go of every tensor it was handed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.errors import DcpFsspecError

ROUNDS = 200


@pytest.fixture
def one_rank_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real gloo group of one rank in this process: its collectives run on worker threads."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every tensor handed to a broadcast or an all-gather, whoever calls it."""
    tensors: list[torch.Tensor] = []

    def recording(collective):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            for arg in args[:2]:
                tensors.extend(arg if isinstance(arg, list) else [arg])
            return collective(*args, **kwargs)

        return call

    for name in ("broadcast", "all_gather"):
        wrapper = recording(getattr(c10d, name))
        monkeypatch.setattr(c10d, name, wrapper)  # torch's object collectives call these
        monkeypatch.setattr(dist, name, wrapper)
    return tensors


def test_every_message_arrives_whole(one_rank_group: None) -> None:
    collectives = Collectives()
    value = {"iteration": 7, "keys": ("model", "optim"), "blob": b"\x00" * 100_000}
    assert collectives.run_on_rank0(lambda: value) == value
    assert collectives.all_gather(value) == [value]
    collectives.raise_if_any_failed(None)


def test_an_error_on_rank0_is_raised_by_every_rank(one_rank_group: None) -> None:
    def fail() -> None:
        raise DcpFsspecError("s3://bucket/run: the pointer is damaged")

    with pytest.raises(DcpFsspecError, match="s3://bucket/run"):
        Collectives().run_on_rank0(fail)


def test_no_method_returns_while_the_group_still_holds_its_tensors(
    one_rank_group: None, handed: list[torch.Tensor]
) -> None:
    collectives = Collectives()
    for i in range(ROUNDS):
        for call in (
            lambda: collectives.run_on_rank0(lambda: i),
            lambda: collectives.all_gather(i),
            lambda: collectives.raise_if_any_failed(None),
        ):
            call()
            held = [t._use_count() for t in handed if t._use_count() > 1]
            assert not held, f"round {i}: the group still holds {len(held)} of the message's tensors"
            handed.clear()
