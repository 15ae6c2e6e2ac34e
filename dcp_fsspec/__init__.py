"""dcp_fsspec: torch.distributed.checkpoint on any fsspec URL, and a training checkpointer.

Layers, bottom up: ``storage`` (DCP StorageWriter/StorageReader over fsspec) ← ``checkpoint``
(iteration layout, commit pointer, retention, background saves) ← ``Checkpointer`` ← CLI.
"""

from __future__ import annotations

from ._version import __version__
from .checkpoint import Checkpointer
from .checkpoint.events import CheckpointEvent
from .errors import (
    BackgroundSaveError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DcpFsspecError,
    InvalidURLError,
    MissingDriverError,
    StorageError,
)
from .storage.reader import FsspecStorageReader
from .storage.retry import RetryPolicy
from .storage.settings import ReaderSettings, WriterSettings
from .storage.trust import SafeLoadPlanner
from .storage.verification import VerifyProblem, VerifyReport
from .storage.writer import FsspecStorageWriter
from .tools.verify import verify

__all__ = [
    "BackgroundSaveError",
    "CheckpointEvent",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DcpFsspecError",
    "FsspecStorageReader",
    "FsspecStorageWriter",
    "InvalidURLError",
    "MissingDriverError",
    "ReaderSettings",
    "RetryPolicy",
    "SafeLoadPlanner",
    "StorageError",
    "__version__",
    "VerifyProblem",
    "VerifyReport",
    "WriterSettings",
    "verify",
]
