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

from ._version import __version__

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
    "FsspecStorageReader": ".storage.reader",
    "FsspecStorageWriter": ".storage.writer",
    "InvalidURLError": ".errors",
    "LocalTier": ".checkpoint.options",
    "MissingDriverError": ".errors",
    "ReaderSettings": ".storage.settings",
    "ResumeOptions": ".checkpoint.options",
    "RetryPolicy": ".storage.retry",
    "SafeLoadPlanner": ".storage.trust",
    "SafetensorsExport": ".tools.safetensors_on_save",
    "SafetensorsStorageReader": ".storage.safetensors_reader",
    "StorageError": ".errors",
    "VerifyProblem": ".storage.verification",
    "VerifyReport": ".storage.verification",
    "WriterSettings": ".storage.settings",
    "verify": ".tools.verify",
}

# The one list of public names; the imports for type checkers below must name the same
# (tests/test_architecture.py keeps them equal).
__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from .checkpoint import Checkpointer
    from .checkpoint.events import CheckpointEvent
    from .checkpoint.options import CheckpointerOptions, LocalTier, ResumeOptions
    from .errors import (
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
    from .storage.reader import FsspecStorageReader
    from .storage.retry import RetryPolicy
    from .storage.safetensors_reader import SafetensorsStorageReader
    from .storage.settings import ReaderSettings, WriterSettings
    from .storage.trust import SafeLoadPlanner
    from .storage.verification import VerifyProblem, VerifyReport
    from .storage.writer import FsspecStorageWriter
    from .tools.safetensors_on_save import SafetensorsExport
    from .tools.verify import verify
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
