"""DCP with storage that does no I/O: the floor any StorageWriter/StorageReader stands on.

``dcp.save``/``dcp.load`` plan, resolve and commit every item themselves, whatever the storage.
This pair keeps each saved tensor by reference and each pickled object as bytes in a dict of
this process, and a load copies them into the targets: a save does no encoding and no I/O, a
load one memory copy. Only ``.metadata`` is pickled and unpickled as torch's format has it
(torch's ``Metadata``, pickled), since a storage layer that keeps the format cannot skip that. What it costs is what DCP itself costs, so no storage layer can do a
save+load faster, and ``torch ÷ floor`` is the most any of them can be ahead of torch.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import (
    StorageReader,
    StorageWriter,
    WriteResult,
)
from torch.futures import Future

_STORE: dict[str, tuple[bytes, dict[MetadataIndex, Any]]] = {}


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class NullWriter(StorageWriter):
    def __init__(self, url: str) -> None:
        self.url = url
        self.kept: dict[MetadataIndex, Any] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.kept = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if isinstance(data, torch.Tensor):
                self.kept[item.index] = data.detach()
            else:  # a BYTE_IO item's stream
                self.kept[item.index] = cast(io.BytesIO, data).getvalue()
            results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=item.index))
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        _STORE[self.url] = (pickle.dumps(metadata), self.kept)

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class NullReader(StorageReader):
    def __init__(self, url: str) -> None:
        self.url = url

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return pickle.loads(_STORE[self.url][0])

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        kept = _STORE[self.url][1]
        for item in plan.items:
            data = kept[item.storage_index]
            if isinstance(data, bytes):
                planner.load_bytes(item, io.BytesIO(data))
                continue
            source = data[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True
