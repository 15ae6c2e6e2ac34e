"""Staging: copying the state to be saved into CPU buffers a background process can read.

Asynchronous saves block training only while this copy runs. The buffers live in shared
memory (so the background process maps them instead of receiving another copy), are pinned
when the source is on CUDA (the device-to-host copies run on a side stream and overlap), and
are allocated once and reused while the state keeps the same structure, shapes and dtypes —
so steady-state staging allocates nothing and holds exactly one staged copy of the state.

The caller must not stage again while a background save still reads the buffers; the
checkpointer waits for the previous save first.

The first stage would otherwise allocate every buffer, and the kernel fills its pages in
during the copy: that first copy costs several later ones. :meth:`Stager.prepare` does both on a
thread of its own, where the state's shapes are known before its first save.
"""

from __future__ import annotations

import copy
import math
import mmap
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class Stager:
    """Copies nested state dicts into reusable shared-memory CPU buffers."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._pinned: set[int] = set()  # data_ptr of buffers registered with CUDA
        self._stream: Any = None
        self._preparing: Future[dict[tuple[Any, ...], torch.Tensor]] | None = None

    def prepare(self, state: dict[str, Any]) -> Future[dict[tuple[Any, ...], torch.Tensor]]:
        """Allocate the buffers ``state`` needs on a thread, with their pages in memory; return at once.

        Only the shapes are read here, on the caller's thread; the values are copied by
        :meth:`stage`, which waits for this first. An allocation error is raised there.
        Returns the allocation: the new buffers, which :meth:`stage` will fill as they are.
        """
        self._adopt_prepared()
        wanted = {}
        for path, tensor in _tensors(state, ()):
            key = _key(path, tensor)
            if key not in self._buffers:
                wanted[key] = tensor.shape
        prepared: Future[dict[tuple[Any, ...], torch.Tensor]] = Future()
        self._preparing = prepared
        threading.Thread(
            target=_allocate_all, args=(wanted, prepared), name="dcp-fsspec-staging", daemon=True
        ).start()
        return prepared

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` whose tensors live in this stager's buffers.

        DTensors keep their mesh and placements around a staged local shard; other values are
        deep-copied, so training may change the originals as soon as this returns.
        """
        self._adopt_prepared()
        used: set[tuple[Any, ...]] = set()
        staged = self._copy(state, (), used)
        # Drop buffers of entries that disappeared, so memory follows the state.
        for path in set(self._buffers) - used:
            self._release(self._buffers.pop(path))
        if self._stream is not None:
            self._stream.synchronize()
        return staged

    def close(self) -> None:
        """Free every buffer (and unpin what was pinned); raise a failed :meth:`prepare`'s error."""
        try:
            self._adopt_prepared()
        finally:
            for buffer in self._buffers.values():
                self._release(buffer)
            self._buffers.clear()

    @property
    def staged_bytes(self) -> int:
        self._adopt_prepared()
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _adopt_prepared(self) -> None:
        """Wait for :meth:`prepare`'s thread, and keep what it allocated."""
        prepared, self._preparing = self._preparing, None
        if prepared is None:
            return
        for key, buffer in prepared.result().items():
            self._buffers[key] = buffer
            if _on_cuda(key) and buffer.numel():
                self._pinned.add(buffer.data_ptr())

    def _copy(self, value: Any, path: tuple[Any, ...], used: set[tuple[Any, ...]]) -> Any:
        if isinstance(value, DTensor):
            local = self._tensor(value.to_local(), path, used)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, used)
        if isinstance(value, dict):
            return {k: self._copy(v, (*path, k), used) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, (*path, i), used) for i, v in enumerate(value)]
            return type(value)(items) if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def _tensor(
        self, tensor: torch.Tensor, path: tuple[Any, ...], used: set[tuple[Any, ...]]
    ) -> torch.Tensor:
        tensor = tensor.detach()
        on_cuda = tensor.device.type == "cuda"
        key = _key(path, tensor)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = _shared_empty(tensor.shape, tensor.dtype)
            if on_cuda and buffer.numel():
                _pin(buffer)
                self._pinned.add(buffer.data_ptr())
            self._buffers[key] = buffer
        used.add(key)
        if on_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            # The side stream must see the tensor's latest value, then copies without blocking.
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                buffer.copy_(tensor, non_blocking=True)
        else:
            buffer.copy_(tensor)
        return buffer

    def _release(self, buffer: torch.Tensor) -> None:
        if buffer.data_ptr() in self._pinned:
            self._pinned.discard(buffer.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def _tensors(value: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """Every tensor :meth:`Stager.stage` copies, with its path: a DTensor's local shard."""
    if isinstance(value, DTensor):
        yield path, value.to_local()
    elif isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, (*path, i))


def _key(path: tuple[Any, ...], tensor: torch.Tensor) -> tuple[Any, ...]:
    """A buffer's key: reused only for a tensor at the same place, of the same dtype and shape."""
    return (*path, tensor.dtype, tuple(tensor.shape), tensor.device.type == "cuda")


def _on_cuda(key: tuple[Any, ...]) -> bool:
    return bool(key[-1])


def _dtype(key: tuple[Any, ...]) -> torch.dtype:
    return key[-3]


def _allocate_all(
    wanted: dict[tuple[Any, ...], torch.Size], done: Future[dict[tuple[Any, ...], torch.Tensor]]
) -> None:
    """:meth:`Stager.prepare`'s thread: every buffer, its pages touched; on an error, none."""
    buffers: dict[tuple[Any, ...], torch.Tensor] = {}
    try:
        for key, shape in wanted.items():
            buffer = _shared_empty(shape, _dtype(key))
            _touch(buffer)
            if _on_cuda(key) and buffer.numel():
                _pin(buffer)
            buffers[key] = buffer
    except BaseException as e:  # noqa: BLE001 - raised by the next stage()
        for key, buffer in buffers.items():
            if _on_cuda(key) and buffer.numel():
                torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        done.set_exception(e)
    else:
        done.set_result(buffers)


def _touch(buffer: torch.Tensor) -> None:
    """Write one byte of each page, so the kernel maps them now rather than during a copy."""
    pages = torch.empty(0, dtype=torch.uint8).set_(buffer.untyped_storage())
    pages[:: mmap.PAGESIZE].zero_()


def _shared_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor allocated in shared memory.

    ``torch.empty(...).share_memory_()`` would allocate private memory, then copy it into a new
    shared segment: a whole extra pass over the state on the first save (1 GiB: ~0.4 s here).
    """
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock a shared-memory buffer so device-to-host copies into it are asynchronous."""
    result = torch.cuda.cudart().cudaHostRegister(
        buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0
    )
    if int(result) != 0:  # pragma: no cover - needs a GPU
        raise RuntimeError(f"cudaHostRegister failed with error {int(result)} for a staging buffer")
