"""Delivering one stored record to the targets of a load: :class:`LoadDecoder`.

The reader (:mod:`~dcp_fsspec.storage.read.reader`) and the exchange of a cooperative load (:mod:`~dcp_fsspec.storage.read.cooperative`) feed
it a record's bytes in order. It copies a tensor's bytes straight into its target where it
can, or holds the record whole and decodes it once, and checks the CRC-32 either way.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import STORAGE_TYPES
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_fsspec.errors import CheckpointMismatchError, CorruptCheckpointError, MissingDriverError
from dcp_fsspec.storage.backends.base import InPlaceFiles
from dcp_fsspec.storage.format.crc import crc32
from dcp_fsspec.storage.format.record_layout import RecordLayout
from dcp_fsspec.storage.format.safe_entries import load_object
from dcp_fsspec.storage.format.tensor_records import tensor_bytes
from dcp_fsspec.storage.format.transforms import UndoQueue, missing_package, untransform, untransformed_limit
from dcp_fsspec.storage.read.cooperative import NeededRecord, record_fqns
from dcp_fsspec.storage.read.record_stream import CRC_TAIL, RecordDecoder, RecordFault


class DecodingOptions(Protocol):
    """What a decoder takes from the reader that makes it."""

    verify_checksums: bool
    trust_checkpoint: bool
    transforms: (
        Any  # torch's reader transforms (see :func:`~dcp_fsspec.storage.format.transforms.reader_transforms`)
    )
    state_dict_metadata: dict[str, STORAGE_TYPES]
    _undo_queue: UndoQueue | None


@dataclass
class LoadRecord(NeededRecord):
    """One stored record (a tensor's archive or a pickled object) and who needs it."""

    transforms: tuple[str, ...] = ()


class LoadDecoder(RecordDecoder):
    """Receives one record's bytes in order and delivers it to its targets.

    The fast path ("direct"): one read item wanting the whole saved tensor, into a contiguous
    target of the same dtype and shape — the storage bytes are copied into the target as they
    arrive. Otherwise the record is held whole and decoded once, then narrowed per item.
    """

    def __init__(self, record: LoadRecord, planner: LoadPlanner, reader: DecodingOptions) -> None:
        super().__init__(record, checksum=reader.settings.verify_checksums)
        self.record = record
        self.planner = planner
        self.trust_checkpoint = reader.settings.trust_checkpoint
        self.transforms = reader.transforms
        self.state_dict_metadata = reader.state_dict_metadata
        self.undo_queue = reader._undo_queue
        self._target: torch.Tensor | None = None
        tensor_items = [i for i in record.items if i.type != LoadItemType.BYTE_IO]
        if not (len(record.items) == 1 and len(tensor_items) == 1 and not record.transforms):
            self.hold_whole()

    def feed(self, view: memoryview) -> None:
        super().feed(view)
        if self.done:
            self._finish()

    def _on_layout(self, layout: RecordLayout) -> None:
        """Decide between copying into the target as bytes arrive, or holding the record whole."""
        spec = layout.spec
        item = self.record.items[0]
        whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == spec.size
        if whole and spec.is_dense:
            target = self.planner.resolve_tensor(item).detach()
            if (
                target.is_contiguous()
                and target.dtype == spec.torch_dtype
                and tuple(target.shape) == spec.size
            ):
                self._target = target
                self.stream_into(tensor_bytes(target) if spec.nbytes else None)
                return
            # The planner handed us a temporary; it must still be committed once, after decoding.
            self._target = target
        self.hold_whole()

    # --- in place (big records) -------------------------------------------------------------

    def rest_in_place(self) -> tuple[memoryview, int]:
        """After the record's first bytes were fed: the memory its remaining bytes go to, and
        where in the record they start — the target's own bytes on the direct path (the
        descriptor after them is read by :meth:`checksum_in_place`), else the record buffer."""
        if self.whole is None and (self.layout is None or self._dest is None):
            self.hold_whole()  # header longer than read, or no data
        if self.whole is not None:
            return self.reserve_whole(), self.received
        assert self.layout is not None and self._dest is not None
        start = max(self.received, self.layout.data_start)
        return self._dest[start - self.layout.data_start :], start

    def checksum_in_place(self, files: InPlaceFiles) -> Callable[[], None]:
        """Once :meth:`rest_in_place` is filled (on a pool thread): the CRC of what was read
        and the descriptor after it; returns the step that delivers the record."""
        rest, start = self.rest_in_place()
        if self.whole is None:
            assert self.layout is not None
            if self.checksum and len(rest):
                self.crc = crc32(rest, self.crc)
            tail_from = max(start + len(rest), self.layout.data_end)
            want = min(CRC_TAIL - len(self._tail), self.record.length - tail_from)
            if want > 0:
                self._tail += files.read(self.record.path, want, self.record.offset + tail_from)

        def deliver() -> None:
            self.received = self.record.length
            self._finish()

        return deliver

    # --- completion -------------------------------------------------------------------------

    def _finish(self) -> None:
        if self.whole is None:
            self._finish_direct()
        else:
            self._finish_held(memoryview(self.whole))
            self.whole = None

    def _finish_direct(self) -> None:
        assert self._target is not None
        fault = self.check_streamed()
        if fault is not None:
            raise self._error(fault)
        self.planner.commit_tensor(self.record.items[0], self._target)

    def _finish_held(self, data: memoryview) -> None:
        if self.record.transforms:
            if self.undo_queue is not None:  # decompress on the pool, deliver here later
                self.undo_queue.submit(
                    lambda: self._untransform(data), lambda raw: self._deliver_all(memoryview(raw))
                )
                return
            data = memoryview(self._untransform(data))
        self._deliver_all(data)

    def _deliver_all(self, data: memoryview) -> None:
        """Decode a whole (untransformed) record once and hand it to each of its read items."""
        rec = self.record
        tensor: torch.Tensor | None = None
        for item in rec.items:
            if item.type == LoadItemType.BYTE_IO:
                self._deliver_bytes(item, bytes(data))
                continue
            if tensor is None:
                decoded = self.decode(data)
                if isinstance(decoded, RecordFault):
                    raise self._error(decoded)
                tensor = decoded
            self._deliver(item, tensor)

    def _deliver_bytes(self, item: ReadItem, data: bytes) -> None:
        """Hand a non-tensor entry to the planner. torch's own ``DefaultLoadPlanner.load_bytes``
        unpickles it in full, so unless the checkpoint is trusted it first has to load with
        ``weights_only`` (:func:`~dcp_fsspec.storage.format.safe_entries.load_object`); planners of our own or the user's decide."""
        rec = self.record
        try:
            if not self.trust_checkpoint and type(self.planner).load_bytes is DefaultLoadPlanner.load_bytes:
                load_object(data, item.dest_index.fqn)
            self.planner.load_bytes(item, io.BytesIO(data))
        except CorruptCheckpointError as e:  # it names the entry; add the file
            raise type(e)(f"{rec.url!r} at bytes [{rec.offset}, {rec.end}): {e}") from e

    def _deliver(self, item: ReadItem, tensor: torch.Tensor) -> None:
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, offset, length)
        target = self._target if self._target is not None and len(self.record.items) == 1 else None
        if target is None:
            target = self.planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointMismatchError(
                f"{item.dest_index.fqn!r}: the checkpoint at {self.record.url!r} holds shape "
                f"{tuple(tensor.size())} but the state dict expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        self.planner.commit_tensor(item, target)

    def _untransform(self, data: memoryview) -> bytearray:
        """Undo torch's experimental stream transforms (e.g. compression) the record was saved with."""
        package = missing_package(self.transforms, self.record.transforms)
        if package is not None:
            raise MissingDriverError(
                f"{self.record.url!r} holds records saved with {list(self.record.transforms)}; install "
                f"{package} to load them: pip install 'dcp-fsspec[zstd]'"
            )
        item = self.record.items[0]
        index = item.storage_index
        limit = untransformed_limit(self.state_dict_metadata.get(index.fqn), index)
        try:
            return untransform(self.transforms, item, self.record.transforms, data, limit)
        except Exception as e:  # noqa: BLE001 - an unknown descriptor or undecodable bytes: damage
            what = f"cannot undo the transforms {list(self.record.transforms)} ({type(e).__name__}: {e})"
            raise self._error(RecordFault(what)) from e

    def _error(self, fault: RecordFault) -> CorruptCheckpointError:
        return fault.exception(self.record, record_fqns(self.record))
