"""``.metadata``'s pickle, unpickled with an allow-list: nothing a crafted file names runs.

Plain ``pickle.loads`` would call any callable the file names (``os.system`` included).
:func:`unpickle_metadata` admits only the classes torch's DCP metadata consists of
(:data:`METADATA_CLASSES`, plus torch's dtypes, layouts and memory formats) and refuses anything
else before it is called. With ``stand_ins``, DCP's classes and torch's constants come back as
the torch-free stand-ins of :mod:`~dcp_fsspec.storage.format.metadata_standins`, so torch is not imported at all. A refusal
is a :class:`~dcp_fsspec.errors.CorruptCheckpointError` naming the class and how to opt in:
``trust_checkpoint=True`` restores plain unpickling, for checkpoints one wrote oneself.
"""

from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

from dcp_fsspec.errors import CorruptCheckpointError, UsageError
from dcp_fsspec.storage.format.metadata_standins import STAND_INS, torch_constant
from dcp_fsspec.storage.transport.gc_pause import collector_paused

# module → names a DCP ``.metadata`` may refer to, each harmless to call with any arguments:
# dataclasses and an enum of DCP's own, torch.Size, torch's layout lookup, plain containers, and a
# path (FileSystemWriter stores its folder as a pathlib path in storage_meta.checkpoint_id). Found
# by unpickling what our writer, FileSystemWriter and FsspecWriter write for every dtype, DTensor
# shards and optimizer state (tests/security/test_code_execution.py loads each).
METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",  # the whole file
            "TensorStorageMetadata",  # a tensor entry: properties, size, chunks
            "ChunkStorageMetadata",  # one saved piece of a tensor (a rank's shard, a DTensor's local part)
            "BytesStorageMetadata",  # a non-tensor entry
            "TensorProperties",  # a tensor's dtype, layout, requires_grad, pinning
            "_MEM_FORMAT_ENCODING",  # the enum TensorProperties pickles its memory format as
            "MetadataIndex",  # the key of storage_data: entry name and chunk offset
            "StorageMeta",  # checkpoint_id, save_id, load_id, modules
        }
    ),
    # Older metadata's TensorProperties: the same dataclass, from before DCP had its own.
    "torch.distributed._shard.sharded_tensor.metadata": frozenset(
        {"TensorProperties", "MEM_FORMAT_ENCODING"}
    ),
    "torch.distributed.checkpoint.filesystem": frozenset(
        {"_StorageInfo"}
    ),  # file, offset, length, transforms
    "torch": frozenset({"Size"}),  # shapes and offsets
    "torch.serialization": frozenset({"_get_layout"}),  # how torch.layout pickles: a lookup by name
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "list", "dict", "tuple"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "pathlib._local": frozenset(
        {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}
    ),  # Python 3.13+
}

TRUST_HINT = (
    "if you wrote this checkpoint yourself, load it with trust_checkpoint=True (CLI: --trust), "
    "which unpickles it in full and so runs any code it holds"
)

# What ``max_entries`` counts: the state dict's entries, and the records that store them.
_COUNTED: dict[tuple[str, str], str] = {
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"): "entries",
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"): "entries",
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "records",
}


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` admits :data:`METADATA_CLASSES` and torch's
    constants (any class with ``trust_checkpoint``), torch's or their stand-ins, and stops past
    ``max_entries`` entries."""

    def __init__(
        self, data: bytes, url: str, *, trust_checkpoint: bool, max_entries: int | None, stand_ins: bool
    ) -> None:
        super().__init__(io.BytesIO(data))
        self.url = url
        self.trust_checkpoint = trust_checkpoint
        self.max_entries = max_entries
        self.stand_ins = stand_ins
        self.counts: dict[str, int] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed(module, name)
        kind = _COUNTED.get((module, name))
        if kind is not None and self.max_entries is not None:
            return self._counted(found, kind)
        return found

    def _allowed(self, module: str, name: str) -> Any:
        if self.stand_ins:
            found = STAND_INS.get((module, name), torch_constant(name) if module == "torch" else None)
            if found is not None:
                return found
        if name in METADATA_CLASSES.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if self.trust_checkpoint:
            return super().find_class(module, name)
        if module == "torch" and not self.stand_ins:
            import torch  # this mode is for loads, which import torch anyway

            # vars(), not getattr(): torch's module __getattr__ imports submodules on first use.
            if isinstance(vars(torch).get(name), (torch.dtype, torch.layout, torch.memory_format)):
                return vars(torch)[name]
        raise CorruptCheckpointError(
            f"{self.url!r} names {module}.{name}, which is not part of DCP metadata, so it was not "
            f"loaded (unpickling it could run any code); {TRUST_HINT}"
        )

    def _counted(self, cls: type, kind: str) -> type:
        """A stand-in for ``cls`` that pickle builds instances with: each is a real ``cls``,
        counted, and past ``max_entries`` of ``kind`` the unpickling stops."""
        unpickler = self

        class Counted:
            def __new__(_: type, *args: Any) -> Any:
                count = unpickler.counts[kind] = unpickler.counts.get(kind, 0) + 1
                if unpickler.max_entries is not None and count > unpickler.max_entries:
                    raise UsageError(
                        f"{unpickler.url!r} holds more than {unpickler.max_entries:,} {kind}, the most "
                        "allowed here; it was not read further. To read it whole, pass a larger "
                        "--max-entries (max_entries=): the whole file is then held in memory"
                    )
                return cls.__new__(cls, *args)

        return Counted


def unpickle_metadata(
    data: bytes,
    url: str,
    *,
    trust_checkpoint: bool = False,
    max_entries: int | None = None,
    stand_ins: bool = False,
) -> Any:
    """Unpickle ``.metadata``'s bytes (read from ``url``), admitting only DCP metadata's classes.

    The garbage collector is paused meanwhile: its passes over the growing heap cost more than
    the unpickling of a big ``.metadata``, and free nothing.

    Args:
        data: the file's bytes.
        url: the file's URL, for messages.
        trust_checkpoint: admit any class (plain unpickling; runs any code).
        max_entries: stop past this many state-dict entries, or this many records.
        stand_ins: build :mod:`~dcp_fsspec.storage.format.metadata_standins`' classes instead of torch's (no torch import).

    Raises:
        CorruptCheckpointError: the pickle names a class outside the allow-list (the message
            names it, and it was never called), or it does not unpickle.
        UsageError: it holds more than ``max_entries`` entries or records.
    """
    unpickler = _MetadataUnpickler(
        data, url, trust_checkpoint=trust_checkpoint, max_entries=max_entries, stand_ins=stand_ins
    )
    try:
        with collector_paused():
            return unpickler.load()
    except (CorruptCheckpointError, UsageError):  # a refusal: the message says what and why
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is damaged
        raise CorruptCheckpointError(
            f"{url!r} is truncated or corrupt ({len(data)} bytes: {type(e).__name__}: {e}); "
            "restore it or load another checkpoint"
        ) from e
