"""The exceptions dcp_fsspec raises.

Every error derives from :class:`DcpFsspecError`, and each also derives from the built-in
exception a caller would naturally catch, so ``except FileNotFoundError`` keeps working::

    DcpFsspecError
    ├── CheckpointNotFoundError    (FileNotFoundError)  no committed checkpoint at the URL
    ├── CheckpointExistsError      (FileExistsError)    a committed checkpoint is in the way
    ├── CorruptCheckpointError     (ValueError)         bytes on storage are not what was written
    │   └── ChecksumMismatchError                       a record's CRC32 does not match its bytes
    ├── RecordFormatError          (ValueError)         internal: bytes we do not decode ourselves (torch.load does)
    ├── CheckpointMismatchError    (ValueError)         the checkpoint does not fit the state dict
    ├── InvalidURLError            (ValueError)         a URL or path that cannot name a checkpoint
    ├── UsageError                 (ValueError)         a command-line argument that cannot be used
    ├── MissingDriverError         (ImportError)        the fsspec driver for a scheme is missing
    ├── StorageError               (OSError)            the backend failed while reading/writing
    │   └── DrainError                                  the durable copy of a local iteration failed
    └── BackgroundSaveError        (RuntimeError)       the background save process died

Every message names the URL or file concerned and what to do next.
"""

from __future__ import annotations


class DcpFsspecError(Exception):
    """Base class of every error raised by dcp_fsspec."""


class CheckpointNotFoundError(DcpFsspecError, FileNotFoundError):
    """There is no committed checkpoint (no ``.metadata``) where one was expected."""


class CheckpointExistsError(DcpFsspecError, FileExistsError):
    """A committed checkpoint already exists and overwriting was not allowed."""


class CorruptCheckpointError(DcpFsspecError, ValueError):
    """A checkpoint file is truncated, garbled or otherwise not what was written."""


class ChecksumMismatchError(CorruptCheckpointError):
    """The CRC32 recorded for an item does not match the bytes read back."""


class RecordFormatError(DcpFsspecError, ValueError):
    """The bytes are not a record we can decode ourselves; fall back to ``torch.load``.

    Internal: the record decoder catches it. It is not damage (torch's own archives may differ
    from the ones we parse), so it is not a :class:`CorruptCheckpointError`.
    """


class CheckpointMismatchError(DcpFsspecError, ValueError):
    """The checkpoint's tensors do not fit the state dict being loaded (shape, dtype, keys)."""


class InvalidURLError(DcpFsspecError, ValueError):
    """A URL or path that cannot name a checkpoint location."""


class UsageError(DcpFsspecError, ValueError):
    """A command-line argument that cannot be used (``dcp-fsspec`` exits with code 2)."""


class MissingDriverError(DcpFsspecError, ImportError):
    """A package this needs is not installed: the fsspec driver for a URL scheme, or an optional
    one (safetensors for ``to-safetensors``, moto for the demo's embedded S3 server)."""


class StorageError(DcpFsspecError, OSError):
    """The storage backend failed while reading or writing a file."""


class DrainError(StorageError):
    """Copying a locally committed iteration to the durable ``save_dirname`` failed (after retries).

    Training goes on (the local tier keeps committing); ``wait()`` and ``finalize()`` raise it
    while the durable tier is behind.
    """


class BackgroundSaveError(DcpFsspecError, RuntimeError):
    """The background save process died or could not start."""


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where Python has it (3.11+); on 3.10 the note is kept in
    ``__notes__`` unprinted, rather than failing while an error is being reported."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # pragma: no cover - Python 3.10
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]
