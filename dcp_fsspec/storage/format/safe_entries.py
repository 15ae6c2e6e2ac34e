"""What a checkpoint we did not write may make us construct: nothing that runs code.

A DCP checkpoint holds two kinds of pickles. ``.metadata`` is one: :mod:`~dcp_fsspec.storage.format.metadata_unpickler`
unpickles it with an allow-list. Non-tensor entries
(``BYTE_IO`` items: ints, strings, a scheduler's dict) are ``torch.save`` archives that torch's
``DefaultLoadPlanner`` loads with ``torch.load(weights_only=False)``; :class:`SafeLoadPlanner`
loads them with ``weights_only=True`` instead (plain Python values, tensors, and what
``torch.serialization.add_safe_globals`` allows). Either refusal is a
:class:`~dcp_fsspec.errors.CorruptCheckpointError` naming what was refused and how to opt in:
``trust_checkpoint=True`` restores plain unpickling, for checkpoints one wrote oneself.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from dcp_fsspec.errors import CorruptCheckpointError
from dcp_fsspec.storage.format.metadata_unpickler import TRUST_HINT


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
