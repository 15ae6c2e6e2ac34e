"""What a checkpoint we did not write may make us construct: nothing that runs code.

A DCP checkpoint holds two kinds of pickles. ``.metadata`` is one, and plain ``pickle.loads``
would call any callable it names (``os.system`` included); :func:`unpickle_metadata` admits
only the classes torch's DCP metadata consists of (:data:`METADATA_CLASSES`, plus torch's
dtypes, layouts and memory formats) and refuses anything else before it is called. Non-tensor
entries (``BYTE_IO`` items: ints, strings, a scheduler's dict) are ``torch.save`` archives that
torch's ``DefaultLoadPlanner`` loads with ``torch.load(weights_only=False)``;
:class:`SafeLoadPlanner` loads them with ``weights_only=True`` instead (plain Python values,
tensors, and what ``torch.serialization.add_safe_globals`` allows). Either refusal is a
:class:`~dcp_fsspec.errors.CorruptCheckpointError` naming what was refused and how to opt in:
``trust_checkpoint=True`` restores plain unpickling, for checkpoints one wrote oneself.
"""

from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import CorruptCheckpointError, UsageError
from .collector import collector_paused

# module → names a DCP ``.metadata`` may refer to, each harmless to call with any arguments:
# dataclasses and an enum of DCP's own, torch.Size, torch's layout lookup, plain containers, and a
# path (FileSystemWriter stores its folder as a pathlib path in storage_meta.checkpoint_id). Found
# by unpickling what our writer, FileSystemWriter and FsspecWriter write for every dtype, DTensor
# shards and optimizer state (tests/security/test_code_execution.py loads each).
METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata",  # the whole file
        "TensorStorageMetadata",  # a tensor entry: properties, size, chunks
        "ChunkStorageMetadata",  # one saved piece of a tensor (a rank's shard, a DTensor's local part)
        "BytesStorageMetadata",  # a non-tensor entry
        "TensorProperties",  # a tensor's dtype, layout, requires_grad, pinning
        "_MEM_FORMAT_ENCODING",  # the enum TensorProperties pickles its memory format as
        "MetadataIndex",  # the key of storage_data: entry name and chunk offset
        "StorageMeta",  # checkpoint_id, save_id, load_id, modules
    }),
    # Older metadata's TensorProperties: the same dataclass, from before DCP had its own.
    "torch.distributed._shard.sharded_tensor.metadata": frozenset({"TensorProperties", "MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),  # file, offset, length, transforms
    "torch": frozenset({"Size"}),  # shapes and offsets
    "torch.serialization": frozenset({"_get_layout"}),  # how torch.layout pickles: a lookup by name
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "list", "dict", "tuple"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),  # Python 3.13+
}
# torch values pickled by name (``torch.float32``, ``torch.strided``): instances, not callables.
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)

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
    constants (any class with ``trust_checkpoint``), and stops past ``max_entries`` entries."""

    def __init__(self, data: bytes, url: str, *, trust_checkpoint: bool, max_entries: int | None) -> None:
        super().__init__(io.BytesIO(data))
        self.url = url
        self.trust_checkpoint = trust_checkpoint
        self.max_entries = max_entries
        self.counts: dict[str, int] = {}

    def find_class(self, module: str, name: str) -> Any:
        kind = _COUNTED.get((module, name))
        if kind is not None and self.max_entries is not None:
            return self._counted(getattr(importlib.import_module(module), name), kind)
        if self.trust_checkpoint:
            return super().find_class(module, name)
        if name in METADATA_CLASSES.get(module, ()):
            return getattr(importlib.import_module(module), name)
        # vars(), not getattr(): torch's module __getattr__ imports submodules on first use.
        if module == "torch" and isinstance(vars(torch).get(name), _TORCH_CONSTANTS):
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
    data: bytes, url: str, *, trust_checkpoint: bool = False, max_entries: int | None = None
) -> Any:
    """Unpickle ``.metadata``'s bytes (read from ``url``), admitting only DCP metadata's classes.

    The garbage collector is paused meanwhile: its passes over the growing heap cost more than
    the unpickling of a big ``.metadata``, and free nothing.

    Args:
        data: the file's bytes.
        url: the file's URL, for messages.
        trust_checkpoint: admit any class (plain unpickling; runs any code).
        max_entries: stop past this many state-dict entries, or this many records.

    Raises:
        CorruptCheckpointError: the pickle names a class outside the allow-list (the message
            names it, and it was never called), or it does not unpickle.
        UsageError: it holds more than ``max_entries`` entries or records.
    """
    try:
        with collector_paused():
            return _MetadataUnpickler(data, url, trust_checkpoint=trust_checkpoint, max_entries=max_entries).load()
    except (CorruptCheckpointError, UsageError):  # a refusal: the message says what and why
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is damaged
        raise CorruptCheckpointError(
            f"{url!r} is truncated or corrupt ({len(data)} bytes: {type(e).__name__}: {e}); "
            "restore it or load another checkpoint"
        ) from e


def load_object(data: bytes, entry: str, *, trust_checkpoint: bool = False) -> Any:
    """The value of a non-tensor entry from its ``torch.save`` bytes, without running its code.

    Args:
        data: the entry's stored bytes.
        entry: its name in the state dict, for messages.
        trust_checkpoint: ``torch.load(weights_only=False)``, as torch's own planner does.

    Raises:
        CorruptCheckpointError: it holds an object ``weights_only`` loading does not construct
            (named, with how to allow it), or the bytes are not a ``torch.save`` archive.
    """
    try:
        if trust_checkpoint:
            return torch.load(io.BytesIO(data), weights_only=False)
        # A BytesIO entry (torch's own e2e train state holds one) is rebuilt from its bytes and
        # position; whatever its __dict__ holds goes through the same weights_only checks.
        with torch.serialization.safe_globals([io.BytesIO]):
            return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        if trust_checkpoint:
            raise _undecodable(entry, e) from e
        refused = ", ".join(_unsafe_globals(data)) or "an object"
        raise CorruptCheckpointError(
            f"entry {entry!r} holds {refused}, which a load that does not trust the checkpoint does not "
            "construct (unpickling it could run any code); allow that class with "
            f"torch.serialization.add_safe_globals, or {TRUST_HINT}"
        ) from None
    except Exception as e:  # noqa: BLE001 - torch.load's errors vary; all mean "not what was saved"
        raise _undecodable(entry, e) from e


def _undecodable(entry: str, error: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"entry {entry!r} cannot be decoded ({type(error).__name__}: {error}); the checkpoint is "
        "corrupt: restore it or load another checkpoint"
    )


def _unsafe_globals(data: bytes) -> list[str]:
    """The classes and functions ``weights_only`` refuses in an archive, read without running it."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception:  # noqa: BLE001 - only for the message; the refusal stands either way
        return []


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner``, loading non-tensor entries without running code from the checkpoint.

    torch's planner loads each non-tensor entry with ``torch.load(weights_only=False)``, which
    runs whatever the pickle names. This one uses ``weights_only=True``: plain Python values,
    tensors, and classes allowed with ``torch.serialization.add_safe_globals`` load as before;
    anything else is a :class:`~dcp_fsspec.errors.CorruptCheckpointError` naming the entry and the
    refused class. Pass it wherever DCP takes a load planner::

        dcp.load(state_dict, storage_reader=FsspecStorageReader(url), planner=SafeLoadPlanner())

    Args:
        flatten_state_dict, flatten_sharded_tensors, allow_partial_load: as ``DefaultLoadPlanner``'s.
        trust_checkpoint: load non-tensor entries as torch's planner does (any object; runs any
            code): only for checkpoints you wrote yourself.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *,
        trust_checkpoint: bool = False,
    ) -> None:
        # Keywords, so a subclass that also derives from another DefaultLoadPlanner subclass
        # (whose own first argument may differ) passes them through unchanged.
        super().__init__(
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
            allow_partial_load=allow_partial_load,
        )
        self.trust_checkpoint = trust_checkpoint

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Put the entry's value where ``DefaultLoadPlanner.load_bytes`` puts it."""
        fqn = read_item.dest_index.fqn
        data = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        obj = load_object(data, fqn, trust_checkpoint=self.trust_checkpoint)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
