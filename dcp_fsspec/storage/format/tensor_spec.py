"""A tensor record's ``data.pkl``, read into a :class:`TensorSpec` without running its code.

The restricted unpickler calls nothing the pickle names but two rebuild functions of ours and
``OrderedDict``. A crafted record can neither run code nor allocate: anything unexpected is a
:class:`~dcp_fsspec.errors.RecordFormatError`. It does not import torch: dtypes come back as
:class:`~dcp_fsspec.storage.format.metadata_standins.DType`, so ``verify`` reads records without it.
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dcp_fsspec.errors import RecordFormatError
from dcp_fsspec.storage.format.metadata_standins import DTYPES, STORAGE_DTYPES, DType, dtype_name

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorSpec:
    """What ``data.pkl`` says about the saved tensor.

    ``dtype`` is a :class:`~dcp_fsspec.storage.format.metadata_standins.DType` (a torch dtype works too); loads use
    :attr:`torch_dtype`.
    """

    dtype: DType
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.storage_numel * self.dtype.itemsize

    @functools.cached_property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype (imports torch; once per spec, and specs are shared by equal headers)."""
        import torch

        dtype = getattr(torch, dtype_name(self.dtype))
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def is_dense(self) -> bool:
        """The storage holds exactly this tensor, row-major (so its bytes can be copied as is)."""
        # Row-major strides as torch gives them (a dimension of 0 counts as 1), in plain Python:
        # this runs once per record of a load, where building a meta tensor would cost more.
        numel, step, row_major = 1, 1, []
        for s in reversed(self.size):
            numel *= s
            row_major.append(step)
            step *= max(s, 1)
        return (
            self.storage_offset == 0
            and numel == self.storage_numel
            and self.stride == tuple(reversed(row_major))
        )


@dataclass(frozen=True)
class _StorageRef:
    dtype: DType
    key: str
    numel: int


def _rebuild_v2(storage: _StorageRef, storage_offset: int, size: Any, stride: Any, *_: Any) -> TensorSpec:
    if not isinstance(storage, _StorageRef):
        raise RecordFormatError("data.pkl rebuilds a tensor from something else than its storage")
    return _spec(storage.dtype, storage.numel, storage_offset, size, stride)


def _rebuild_v3(
    storage: _StorageRef,
    storage_offset: int,
    size: Any,
    stride: Any,
    _grad: Any,
    _hooks: Any,
    dtype: Any,
    *_: Any,
) -> TensorSpec:
    if not isinstance(storage, _StorageRef) or not isinstance(dtype, DType):
        raise RecordFormatError("data.pkl rebuilds a tensor from something else than its storage and dtype")
    # Newer dtypes (float8, uint16, …) pickle an untyped storage counted in bytes.
    return _spec(dtype, storage.numel // dtype.itemsize, storage_offset, size, stride)


def _spec(dtype: DType, numel: int, storage_offset: Any, size: Any, stride: Any) -> TensorSpec:
    """A :class:`TensorSpec` of plain non-negative ints, or RecordFormatError (a crafted data.pkl)."""
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride) or not all(
        type(v) is int and v >= 0 for v in (numel, storage_offset, *size, *stride)
    ):
        raise RecordFormatError("data.pkl gives a tensor an offset, shape or strides that are not ints >= 0")
    return TensorSpec(dtype, numel, storage_offset, size, stride)


@dataclass(frozen=True)
class _StorageType:
    """Stands in for a storage class named in ``data.pkl``: its dtype, and nothing to call."""

    dtype: DType


class _SpecUnpickler(pickle.Unpickler):
    """Reads a tensor record's ``data.pkl`` into a :class:`TensorSpec`, refusing anything else.

    Nothing the pickle names is called except our own two rebuild functions (which only build a
    :class:`TensorSpec`) and ``OrderedDict`` (torch pickles a tensor's hooks as one): storage
    classes come back as :class:`_StorageType` values and dtypes as :class:`DType`, neither callable,
    so a crafted record can neither run code nor allocate.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _StorageType(STORAGE_DTYPES[name])
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if module == "torch" and name in DTYPES:
            return DTYPES[name]
        raise RecordFormatError(f"unexpected global {module}.{name} in a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise RecordFormatError("unexpected persistent id in a tensor record")
        _, storage_type, key, _location, numel = pid
        if isinstance(storage_type, _StorageType):
            dtype = storage_type.dtype
        elif isinstance(storage_type, DType):
            dtype = storage_type
        else:
            raise RecordFormatError("unexpected storage type in a tensor record")
        return _StorageRef(dtype, str(key), int(numel))


_PICKLE_WINDOW = 1 << 16  # a tensor's data.pkl is a few hundred bytes


def parse_pickle(buf: memoryview) -> tuple[TensorSpec, int] | None:
    """The tensor ``buf``'s leading ``data.pkl`` describes, and that pickle's length in bytes;
    ``None`` if ``buf`` is too short to say yet."""
    stream = io.BytesIO(buf[:_PICKLE_WINDOW])
    try:
        spec = _SpecUnpickler(stream).load()
    except (EOFError, pickle.UnpicklingError, IndexError, struct.error) as e:
        if len(buf) < _PICKLE_WINDOW:
            return None
        raise RecordFormatError("unreadable data.pkl") from e
    except RecordFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - arguments of the wrong type for what it names: not ours to read
        raise RecordFormatError(f"data.pkl does not describe a tensor ({type(e).__name__})") from e
    if not isinstance(spec, TensorSpec):
        raise RecordFormatError("data.pkl does not hold a single tensor")
    return spec, stream.tell()
