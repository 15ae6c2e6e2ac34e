"""torch.save's archive around one tensor, written directly instead of by running torch.save.

``torch.save(tensor)`` writes an uncompressed zip through torch's ``PyTorchStreamWriter``:
``archive/data.pkl`` (the pickled tensor, its storage as a persistent id), a few constant
entries (``.format_version``, ``.storage_alignment``, ``byteorder``, ``version``,
``.data/serialization_id`` in torch 2.13), and ``archive/data/0`` (the storage bytes). Every
local header carries an ``FB`` extra field padding its data to a 64-byte boundary; every entry
is followed by a data descriptor; a central directory, a zip64 end record, its locator and the
end record close the archive.

Running torch.save has a fixed cost per tensor (its zip writer, pickler and config lookups),
which dominates checkpoints of many small tensors. :class:`ArchiveFormat` writes the same bytes
without it. It learns the constant entries from one ``torch.save`` of a sample tensor per
dtype and is used only if the archive it writes for that sample is byte for byte torch's
(:meth:`ArchiveFormat.learn`), so a torch that changes its format costs speed, never
compatibility: the caller then keeps using torch.save.
"""

from __future__ import annotations

import io
import pickle
import secrets
import struct
import zipfile
import zlib
from collections import OrderedDict
from typing import Any

import torch

_ALIGNMENT = 64
_FLAGS = 0x0808  # sizes and CRC in a data descriptor; UTF-8 names
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_ZIP64_MADE_BY, _ZIP64_NEEDED = 0x031E, 0x002D

# Past 4 GiB torch's writer switches entries to zip64 fields, which this module does not write;
# such tensors are few and large, and torch.save's cost is nothing next to their bytes.
MAX_DATA_BYTES = 0xFFFFFFFF - (1 << 20)

_PICKLE_NAME = "data.pkl"
_DATA_NAME = "data/0"
_ID_NAME = ".data/serialization_id"

# One id per process, as torch writes one per archive; torch only logs it.
_SERIALIZATION_ID = f"{secrets.randbits(64):020d}{secrets.randbits(64):020d}".encode()


def can_write(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (as :func:`records.storage_ready` returns it) pickles the plain way:
    a dense CPU ``torch.Tensor`` without conjugate or negative bits."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.untyped_storage().nbytes() <= MAX_DATA_BYTES
    )


class _Storage:
    """Stands in for the tensor's storage; pickled as torch's persistent id."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _Rebuild:
    """Pickles as torch pickles a tensor: ``rebuild(storage, offset, size, stride, …)``."""

    __slots__ = ("args", "rebuild")

    def __init__(self, rebuild: Any, args: tuple[Any, ...]) -> None:
        self.rebuild = rebuild
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.rebuild, self.args)


class _TensorPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _Storage else None


def pickle_tensor(tensor: torch.Tensor) -> bytes:
    """``data.pkl`` for ``tensor`` as torch.save writes it (protocol 2, storage key ``"0"``)."""
    if tensor.dtype in torch.storage._new_dtypes():
        storage = _Storage(("storage", torch.UntypedStorage, "0", "cpu", tensor.untyped_storage().nbytes()))
        rebuild: Any = torch._utils._rebuild_tensor_v3
        extra: tuple[Any, ...] = (tensor.dtype,)
    else:
        storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[tensor.dtype])
        storage = _Storage(
            ("storage", storage_type, "0", "cpu", tensor.untyped_storage().nbytes() // tensor.element_size())
        )
        rebuild, extra = torch._utils._rebuild_tensor_v2, ()
    args = (
        storage,
        tensor.storage_offset(),
        tuple(tensor.size()),
        tensor.stride(),
        False,
        OrderedDict(),
        *extra,
    )
    out = io.BytesIO()
    _TensorPickler(out, protocol=2).dump(_Rebuild(rebuild, args))
    return out.getvalue()


class ArchiveFormat:
    """The entries torch.save writes around a tensor, and how to frame them as torch does."""

    def __init__(self, prefix: bytes, entries: tuple[tuple[bytes, bytes | None], ...]) -> None:
        """``entries``: (name, contents) in torch's order; contents None for data.pkl, data/0
        and the serialization id, which differ per archive."""
        # (full name, what goes in it, CRC-32 of constant contents): a constant's bytes, or which
        # per-archive value (_PICKLE_NAME, _DATA_NAME, _ID_NAME) fills it.
        self._entries = [
            (prefix + name, contents if contents is not None else name.decode(), zlib.crc32(contents or b""))
            for name, contents in entries
        ]

    @classmethod
    def learn(cls, dtype: torch.dtype) -> ArchiveFormat | None:
        """Read torch.save's archive of a sample ``dtype`` tensor; ``None`` unless this
        module reproduces it exactly (then the caller keeps using torch.save)."""
        sample = torch.zeros(3, 2, dtype=dtype)
        buffer = io.BytesIO()
        torch.save(sample, buffer)
        expected = buffer.getvalue()
        try:
            with zipfile.ZipFile(io.BytesIO(expected)) as archive:
                infos = archive.infolist()
                prefix = infos[0].filename.split("/", 1)[0] + "/"
                entries: list[tuple[bytes, bytes | None]] = []
                serialization_id = b""
                for info in infos:
                    name = info.filename[len(prefix) :]
                    contents = archive.read(info)
                    if name == _ID_NAME:
                        serialization_id = contents
                    entries.append(
                        (name.encode(), None if name in (_PICKLE_NAME, _DATA_NAME, _ID_NAME) else contents)
                    )
            fmt = cls(prefix.encode(), tuple(entries))
            data = bytes(sample.reshape(-1).view(torch.uint8).tolist())  # a small sample; no numpy
            header, trailer = fmt.frame(pickle_tensor(sample), len(data), zlib.crc32(data), serialization_id)
        except (
            zipfile.BadZipFile,
            IndexError,
            KeyError,
            AttributeError,
            ValueError,
            RuntimeError,
            struct.error,
        ):
            return None
        if header + data + trailer != expected:
            return None
        return fmt

    def frame(
        self, data_pkl: bytes, nbytes: int, crc: int, serialization_id: bytes = _SERIALIZATION_ID
    ) -> tuple[bytes, bytes]:
        """The archive's bytes before and after ``nbytes`` of tensor data whose CRC-32 is ``crc``."""
        if nbytes > MAX_DATA_BYTES:
            raise ValueError(f"{nbytes} bytes of tensor data need zip64 entries")
        head: list[bytes] = []
        tail: list[bytes] = []
        central: list[bytes] = []
        out = head
        offset = 0
        for full_name, contents, contents_crc in self._entries:
            body: bytes | None
            if isinstance(contents, bytes):
                body, size, entry_crc = contents, len(contents), contents_crc
            elif contents == _DATA_NAME:
                body, size, entry_crc = None, nbytes, crc
            else:
                body = data_pkl if contents == _PICKLE_NAME else serialization_id
                size, entry_crc = len(body), zlib.crc32(body)
            start = offset + _LOCAL.size + len(full_name) + 4
            pad = -start % _ALIGNMENT
            out.append(_LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(full_name), pad + 4))
            out.append(full_name)
            out.append(b"FB" + pad.to_bytes(2, "little") + b"Z" * pad)
            if body is None:
                out = tail  # the tensor's bytes go between header and trailer
            else:
                out.append(body)
            out.append(_DESCRIPTOR.pack(0x08074B50, entry_crc, size, size))
            central.append(
                _CENTRAL.pack(
                    0x02014B50,
                    0,
                    0,
                    _FLAGS,
                    0,
                    0,
                    0,
                    entry_crc,
                    size,
                    size,
                    len(full_name),
                    0,
                    0,
                    0,
                    0,
                    0,
                    offset,
                )
            )
            central.append(full_name)
            offset = start + pad + size + _DESCRIPTOR.size
        count = len(self._entries)
        central_size = sum(len(c) for c in central)
        tail += central
        tail.append(
            _ZIP64_END.pack(
                0x06064B50,
                _ZIP64_END.size - 12,
                _ZIP64_MADE_BY,
                _ZIP64_NEEDED,
                0,
                0,
                count,
                count,
                central_size,
                offset,
            )
        )
        tail.append(_ZIP64_LOCATOR.pack(0x07064B50, 0, offset + central_size, 1))
        tail.append(_END.pack(0x06054B50, 0, 0, count, count, central_size, offset, 0))
        return b"".join(head), b"".join(tail)
