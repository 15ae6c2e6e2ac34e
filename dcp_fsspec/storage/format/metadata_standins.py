"""Torch-free stand-ins for the classes DCP's ``.metadata`` pickles, and for torch's dtypes.

Importing torch takes seconds. The tools that only read what a checkpoint says (``inspect``,
``verify``) unpickle ``.metadata`` into these instead (see :func:`~dcp_fsspec.storage.format.metadata_file.read_metadata`).
Each stand-in has the fields of the torch class it replaces, so code that reads fields works on
either. None of them runs anything when built: they only hold what the pickle gives them.
:data:`STAND_INS` maps the names a pickle uses to them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DType:
    """A torch dtype by name: ``str()`` gives ``"torch.float32"``, as for torch's own."""

    name: str
    itemsize: int

    def __str__(self) -> str:
        return f"torch.{self.name}"


# Every torch dtype: its name in torch's namespace (aliases too) → canonical name, bytes per
# element. tests/test_cli_startup.py checks it against the installed torch.
_DTYPES: dict[str, tuple[str, int]] = {
    "bfloat16": ("bfloat16", 2),
    "bit": ("uint1", 1),
    "bits16": ("bits16", 2),
    "bits1x8": ("bits1x8", 1),
    "bits2x4": ("bits2x4", 1),
    "bits4x2": ("bits4x2", 1),
    "bits8": ("bits8", 1),
    "bool": ("bool", 1),
    "cdouble": ("complex128", 16),
    "cfloat": ("complex64", 8),
    "chalf": ("complex32", 4),
    "complex128": ("complex128", 16),
    "complex32": ("complex32", 4),
    "complex64": ("complex64", 8),
    "double": ("float64", 8),
    "float": ("float32", 4),
    "float16": ("float16", 2),
    "float32": ("float32", 4),
    "float4_e2m1fn_x2": ("float4_e2m1fn_x2", 1),
    "float64": ("float64", 8),
    "float8_e4m3fn": ("float8_e4m3fn", 1),
    "float8_e4m3fnuz": ("float8_e4m3fnuz", 1),
    "float8_e5m2": ("float8_e5m2", 1),
    "float8_e5m2fnuz": ("float8_e5m2fnuz", 1),
    "float8_e8m0fnu": ("float8_e8m0fnu", 1),
    "half": ("float16", 2),
    "int": ("int32", 4),
    "int1": ("int1", 1),
    "int2": ("int2", 1),
    "int3": ("int3", 1),
    "int4": ("int4", 1),
    "int5": ("int5", 1),
    "int6": ("int6", 1),
    "int7": ("int7", 1),
    "int8": ("int8", 1),
    "int16": ("int16", 2),
    "int32": ("int32", 4),
    "int64": ("int64", 8),
    "long": ("int64", 8),
    "qint32": ("qint32", 4),
    "qint8": ("qint8", 1),
    "quint2x4": ("quint2x4", 1),
    "quint4x2": ("quint4x2", 1),
    "quint8": ("quint8", 1),
    "short": ("int16", 2),
    "uint1": ("uint1", 1),
    "uint2": ("uint2", 1),
    "uint3": ("uint3", 1),
    "uint4": ("uint4", 1),
    "uint5": ("uint5", 1),
    "uint6": ("uint6", 1),
    "uint7": ("uint7", 1),
    "uint8": ("uint8", 1),
    "uint16": ("uint16", 2),
    "uint32": ("uint32", 4),
    "uint64": ("uint64", 8),
}
DTYPES: dict[str, DType] = {name: DType(*canonical) for name, canonical in _DTYPES.items()}

# torch's typed storage classes, as a tensor record's data.pkl names them → their dtype.
STORAGE_DTYPES: dict[str, DType] = {
    f"{prefix}Storage": DTYPES[name]
    for prefix, name in (
        ("BFloat16", "bfloat16"),
        ("Bool", "bool"),
        ("Byte", "uint8"),
        ("Char", "int8"),
        ("ComplexDouble", "complex128"),
        ("ComplexFloat", "complex64"),
        ("Double", "float64"),
        ("Float", "float32"),
        ("Half", "float16"),
        ("Int", "int32"),
        ("Long", "int64"),
        ("QInt32", "qint32"),
        ("QInt8", "qint8"),
        ("QUInt2x4", "quint2x4"),
        ("QUInt4x2", "quint4x2"),
        ("QUInt8", "quint8"),
        ("Short", "int16"),
        ("Untyped", "uint8"),
        ("", "float32"),
    )
}


def dtype_name(dtype: object) -> str:
    """``"float32"`` for ``torch.float32`` or its :class:`DType`: how a dtype of either kind compares."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class _Named:
    """A torch layout or memory format, by name (``.metadata`` names them; nothing reads them)."""

    name: str


_LAYOUTS = frozenset(
    {"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged"}
)
_MEMORY_FORMATS = frozenset(
    {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format", "legacy_contiguous_format"}
)


def torch_constant(name: str) -> DType | _Named | None:
    """The stand-in of ``torch.<name>``, a dtype, layout or memory format; ``None`` for anything else."""
    if name in DTYPES:
        return DTYPES[name]
    return _Named(name) if name in _LAYOUTS or name in _MEMORY_FORMATS else None


def _get_layout(name: object) -> _Named:
    """Stands in for ``torch.serialization._get_layout``: how torch pickles a layout."""
    if not isinstance(name, str) or name.removeprefix("torch.") not in _LAYOUTS:
        raise ValueError(f"unknown layout {name!r}")
    return _Named(name.removeprefix("torch."))


def _size(values: Any = ()) -> tuple[Any, ...]:
    """Stands in for ``torch.Size``: a plain tuple (:mod:`~dcp_fsspec.storage.format.metadata_file` checks its items)."""
    return tuple(values)


class _MemFormatEncoding(enum.Enum):
    """Stands in for DCP's ``_MEM_FORMAT_ENCODING`` (and the sharded tensor's older twin)."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


@dataclass
class ChunkStorageMetadata:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass
class TensorProperties:
    """DCP pickles it as a 5-tuple (``__getstate__``); the memory format as its encoding."""

    dtype: Any = None
    layout: Any = None
    requires_grad: bool = False
    memory_format: Any = None
    pin_memory: bool = False

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):  # a pickle of some other version: fields by name
            for name in ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"):
                setattr(self, name, state.get(name))
            return
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: tuple[int, ...]
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    """Equal and hashed by ``fqn`` and ``offset``, as DCP's (``index`` is only a hint)."""

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(hash=False, compare=False, default=None)


@dataclass
class StorageInfo:
    """Stands in for ``torch.distributed.checkpoint.filesystem._StorageInfo``: where a record is."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


_METADATA = "torch.distributed.checkpoint.metadata"
_LEGACY = "torch.distributed._shard.sharded_tensor.metadata"

# (module, name) as a pickle names them → the stand-in.
STAND_INS: dict[tuple[str, str], Any] = {
    (_METADATA, "Metadata"): Metadata,
    (_METADATA, "TensorStorageMetadata"): TensorStorageMetadata,
    (_METADATA, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_METADATA, "BytesStorageMetadata"): BytesStorageMetadata,
    (_METADATA, "TensorProperties"): TensorProperties,
    (_METADATA, "_MEM_FORMAT_ENCODING"): _MemFormatEncoding,
    (_METADATA, "MetadataIndex"): MetadataIndex,
    (_METADATA, "StorageMeta"): StorageMeta,
    (_LEGACY, "TensorProperties"): TensorProperties,
    (_LEGACY, "MEM_FORMAT_ENCODING"): _MemFormatEncoding,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _get_layout,
}
