"""Small helpers shared by the storage tests: save/load through DCP, and DCP's error wrapping."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsspec import (
    Checkpointer,
    FsspecStorageReader,
    FsspecStorageWriter,
    ReaderSettings,
    RetryPolicy,
    StorageError,
    WriterSettings,
)
from tests.conftest import Backend
from tests.servers.throttling import ThrottlingProxy


def _with_settings(settings_class: type, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the fields of ``settings_class`` gathered into ``settings=``."""
    fields = {f.name for f in dataclasses.fields(settings_class)}
    chosen = {k: v for k, v in options.items() if k in fields}
    rest = {k: v for k, v in options.items() if k not in fields}
    return {**rest, "settings": settings_class(**chosen)} if chosen else rest


def save(state: dict, backend: Backend, url: str | None = None, **options: Any) -> None:
    """``dcp.save`` with our writer; ``options`` may mix its keywords and WriterSettings' fields."""
    options = _with_settings(WriterSettings, options)
    writer = FsspecStorageWriter(url or backend.url, storage_options=backend.storage_options, **options)
    dcp.save(state, storage_writer=writer, no_dist=True)


def load(state: dict, backend: Backend, url: str | None = None, **options: Any) -> dict:
    """``dcp.load`` with our reader; ``options`` may mix its keywords and ReaderSettings' fields."""
    options = _with_settings(ReaderSettings, options)
    reader = FsspecStorageReader(url or backend.url, storage_options=backend.storage_options, **options)
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


class Raised:
    """The original exception once the block has raised (DCP's wrapper removed)."""

    value: BaseException


@contextmanager
def raises_through_dcp(kind: type[BaseException]) -> Iterator[Raised]:
    """Expect ``kind``, raised directly or inside DCP's ``CheckpointException`` (a BaseException)."""
    raised = Raised()
    try:
        yield raised
    except CheckpointException as e:
        originals = [exc for exc, _trace in e.failures.values()]
        matching = [exc for exc in originals if isinstance(exc, kind)]
        assert matching, f"expected {kind.__name__}, DCP reported {originals!r}"
        raised.value = matching[0]
    except kind as e:
        raised.value = e
    else:
        raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def differences_outside_the_serialization_id(ours: bytes, theirs: bytes) -> list[int]:
    """Byte positions where two archives differ, other than torch's per-archive id (40 digits)
    and its CRC-32 (in the entry's data descriptor and its central directory entry)."""
    name = b"archive/.data/serialization_id"
    local = theirs.find(name)
    start = (
        local
        + len(name)
        + 4
        + int.from_bytes(theirs[local + len(name) + 2 : local + len(name) + 4], "little")
    )
    central = theirs.rfind(name) - 46
    allowed = (
        set(range(start, start + 40))
        | set(range(start + 44, start + 48))
        | set(range(central + 16, central + 20))
    )
    assert len(ours) == len(theirs)
    return [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b and i not in allowed]


def flip_a_byte_of_each_data_file_once_written(patch: pytest.MonkeyPatch) -> None:
    """On local disk, as a faulty disk would: each data file's middle byte changes after the file
    is written whole, before the commit."""
    from dcp_fsspec.storage.backends.local import LocalUpload

    real_commit = LocalUpload.commit

    def flip(self: LocalUpload) -> None:
        real_commit(self)
        if self.path.endswith(".distcp"):
            with open(self.path, "r+b") as f:
                f.seek(self.size // 2)
                byte = f.read(1)
                f.seek(self.size // 2)
                f.write(bytes([byte[0] ^ 0x01]))

    patch.setattr(LocalUpload, "commit", flip)


def assert_throttling_that_never_clears_fails_in_one_line(
    backend: Backend, proxy: ThrottlingProxy, *kinds: str
) -> None:
    """A save through ``proxy`` refusing every request fails in one line naming the URL, the
    request kind (one of ``kinds``: drivers name it their own way) and the remedy."""
    proxy.set_rate(0, burst=0)
    retry = RetryPolicy(attempts=2, base_delay=0.01, deadline=3)
    with pytest.raises(StorageError) as failure:
        with Checkpointer(backend.url, backend.storage_options, retry=retry) as ckpt:
            ckpt.save(1, model=nn.Linear(4, 4))
    message = str(failure.value)
    assert "\n" not in message
    assert backend.url in message
    assert any(f"throttled {kind} requests" in message for kind in kinds), message
    assert "RetryPolicy(deadline=" in message
