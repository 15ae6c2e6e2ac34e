"""What an attacker puts into a checkpoint: payloads that would run code, and edited ``.metadata``.

Each payload, if unpickled by plain ``pickle``/``torch.load(weights_only=False)``, creates a
marker file; a test asserts the marker never appears. The ``.metadata`` is edited by unpickling
the real one (the test trusts its own file), changing it, and pickling it back, as an attacker
with write access to the bucket would.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner

from dcp_fsspec import FsspecStorageReader, ReaderSettings
from dcp_fsspec.storage.transport.error_wrapping import unwrap_dcp
from tests.conftest import Backend


class OpenPayload:
    """Unpickles as ``open(marker, "w")``: creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return open, (self.marker, "w")


class SystemPayload:
    """Unpickles as ``os.system("touch marker")``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return os.system, (f"touch {self.marker}",)


# The name each payload's callable is pickled under (what a refusal names).
PAYLOADS: dict[str, tuple[type, str]] = {
    "open": (OpenPayload, f"{open.__module__}.open"),
    "os.system": (SystemPayload, f"{os.system.__module__}.system"),
}


@dataclass
class Note:
    """An arbitrary picklable object: no side effects, but not on any allow-list."""

    text: str


def fs_path(backend: Backend, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url, **backend.storage_options)
    fs.invalidate_cache()
    return fs, path


def edit_metadata(backend: Backend, checkpoint_url: str, edit: Callable[[Metadata], Any]) -> str:
    """Apply ``edit`` to the ``.metadata`` of the checkpoint at ``checkpoint_url``; its URL."""
    url = checkpoint_url.rstrip("/") + "/.metadata"
    fs, path = fs_path(backend, url)
    metadata = pickle.loads(fs.cat_file(path))
    edit(metadata)
    fs.pipe_file(path, pickle.dumps(metadata))
    fs.invalidate_cache()
    return url


def smuggle(value: Any) -> Callable[[Metadata], None]:
    """An edit that hides ``value`` in ``.metadata`` (an extra attribute DCP never looks at)."""

    def edit(metadata: Metadata) -> None:
        metadata.__dict__["extra"] = value

    return edit


def storage_entry(metadata: Metadata, fqn: str) -> Any:
    """The ``_StorageInfo`` of entry ``fqn`` (its first chunk)."""
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


def load_failure(
    state: dict[str, Any],
    backend: Backend,
    url: str | None = None,
    planner: LoadPlanner | None = None,
    **options: Any,
) -> BaseException:
    """What ``dcp.load`` with our reader failed with, as the Checkpointer and the CLI raise it.

    (torch >= 2.9 reports a failed ``.metadata`` read as an ``AssertionError`` of its own; the
    reader keeps ours, and ``unwrap_dcp`` raises it.)
    """
    reader = FsspecStorageReader(
        url or backend.url, storage_options=backend.storage_options, settings=ReaderSettings(**options)
    )
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:
        return unwrap_dcp(
            e, f"loading {reader.location.url}", mismatch=True, metadata_failure=reader.metadata_failure
        )
    raise AssertionError("the load succeeded")
