"""Turning what backends and DCP raise into our errors, in one place.

Backends raise their own types (``OSError`` subclasses, botocore's, asyncssh's ``SFTPFailure``),
and DCP wraps every rank's exception in ``CheckpointException``. Callers above the storage layer
catch :class:`~dcp_fsspec.errors.DcpFsspecError` and its subclasses, and read one line naming
the URL: :func:`storage_errors` wraps a backend call, :func:`unwrap_dcp` unwraps DCP's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from dcp_fsspec.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    DcpFsspecError,
    RecordFormatError,
    StorageError,
)

if TYPE_CHECKING:  # only for a type: tools that never run DCP (ls, prune, cp) must not import torch
    from torch.distributed.checkpoint.api import CheckpointException


@contextmanager
def storage_errors(verb: str, url: str, *, also: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Inside the block, a backend failure becomes ``StorageError("cannot {verb} {url}: …")``.

    Our own errors pass through unchanged, and so does ``FileNotFoundError``: what absence means
    is the caller's decision (a missing checkpoint, a missing data file, nothing to delete).

    Args:
        verb: what was being done, for the message ("read", "write", "list", "delete").
        url: the file or folder concerned, as the user would write it.
        also: further exception types (a driver's own, not derived from ``OSError``) to wrap.
    """
    wrapped: tuple[type[BaseException], ...] = (OSError, *also)
    try:
        yield
    except (DcpFsspecError, FileNotFoundError):
        raise
    except wrapped as e:
        raise StorageError(f"cannot {verb} {url}: {e}") from e


def unwrap_dcp(
    error: CheckpointException, action: str, *, mismatch: bool, metadata_failure: DcpFsspecError | None = None
) -> Exception:
    """One of our exceptions for DCP's per-rank ``CheckpointException``.

    Our storage layer's own errors pass through unchanged, but for the decoder's internal
    ``RecordFormatError``, which becomes the ``CorruptCheckpointError`` it means; backend
    ``OSError``s become ``StorageError``; anything else on load (``mismatch``) means the checkpoint
    does not fit the live objects, and on save it is reported as it is.

    Args:
        error: what ``dcp.save``/``dcp.load`` raised.
        action: what was being done, naming the URL ("loading key 'model' from s3://…").
        mismatch: whether an unknown failure means the checkpoint does not fit (loads).
        metadata_failure: the reader's ``metadata_failure``: why its ``.metadata`` could not be
            used. torch >= 2.9 reports that as an ``AssertionError`` of its own, which would read
            as a mismatch; this is the error to raise instead.
    """
    if metadata_failure is not None:
        return metadata_failure
    ranks = sorted(error.failures)
    first, _traceback = error.failures[ranks[0]]
    if isinstance(first, RecordFormatError):
        return CorruptCheckpointError(f"{action} failed on rank(s) {ranks}: {first}")
    if isinstance(first, DcpFsspecError):
        return first
    if isinstance(first, OSError):
        cls: type[DcpFsspecError] = StorageError
    else:
        cls = CheckpointMismatchError if mismatch else DcpFsspecError
    return cls(f"{action} failed on rank(s) {ranks}: {type(first).__name__}: {first}")
