"""dcp_fsspec: torch.distributed.checkpoint on any fsspec URL, and a training checkpointer.

Layers, bottom up: ``storage`` (DCP StorageWriter/StorageReader over fsspec) ← ``checkpoint``
(iteration layout, commit pointer, retention, background saves) ← ``Checkpointer`` ← CLI.

The public names are imported on first use (PEP 562), not with the package: most of them need
torch, which takes seconds to import, and the ``dcp-fsspec`` command imports this package before
it knows whether the subcommand needs torch at all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dcp_fsspec._version import __version__

# Public name → the module that defines it.
_EXPORTS: dict[str, str] = {
    "BackgroundSaveError": ".errors",
    "CheckpointEvent": ".checkpoint.events",
    "CheckpointExistsError": ".errors",
    "CheckpointMismatchError": ".errors",
    "CheckpointNotFoundError": ".errors",
    "Checkpointer": ".checkpoint",
    "CheckpointerOptions": ".checkpoint.options",
    "ChecksumMismatchError": ".errors",
    "CorruptCheckpointError": ".errors",
    "DcpFsspecError": ".errors",
    "DrainError": ".errors",
    "FsspecStorageReader": ".storage.read.reader",
    "FsspecStorageWriter": ".storage.write.writer",
    "InvalidURLError": ".errors",
    "LocalTier": ".checkpoint.options",
    "MissingDriverError": ".errors",
    "ReaderSettings": ".storage.settings",
    "ResumeOptions": ".checkpoint.options",
    "RetryPolicy": ".storage.transport.retry",
    "SafeLoadPlanner": ".storage.format.safe_entries",
    "SafetensorsExport": ".tools.safetensors.on_save",
    "SafetensorsStorageReader": ".storage.read.safetensors_reader",
    "StorageError": ".errors",
    "VerifyProblem": ".storage.checkpoint_files.integrity",
    "VerifyReport": ".storage.checkpoint_files.integrity",
    "WriterSettings": ".storage.settings",
    "verify": ".tools.verify",
}

# The one list of public names; the imports for type checkers below must name the same
# (tests/test_architecture.py keeps them equal).
__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from dcp_fsspec.checkpoint import Checkpointer
    from dcp_fsspec.checkpoint.events import CheckpointEvent
    from dcp_fsspec.checkpoint.options import CheckpointerOptions, LocalTier, ResumeOptions
    from dcp_fsspec.errors import (
        BackgroundSaveError,
        CheckpointExistsError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        ChecksumMismatchError,
        CorruptCheckpointError,
        DcpFsspecError,
        DrainError,
        InvalidURLError,
        MissingDriverError,
        StorageError,
    )
    from dcp_fsspec.storage.checkpoint_files.integrity import VerifyProblem, VerifyReport
    from dcp_fsspec.storage.format.safe_entries import SafeLoadPlanner
    from dcp_fsspec.storage.read.reader import FsspecStorageReader
    from dcp_fsspec.storage.read.safetensors_reader import SafetensorsStorageReader
    from dcp_fsspec.storage.settings import ReaderSettings, WriterSettings
    from dcp_fsspec.storage.transport.retry import RetryPolicy
    from dcp_fsspec.storage.write.writer import FsspecStorageWriter
    from dcp_fsspec.tools.safetensors.on_save import SafetensorsExport
    from dcp_fsspec.tools.verify import verify
else:

    def __getattr__(name: str) -> Any:
        """Import a public name's module on first use, and keep the name here."""
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
