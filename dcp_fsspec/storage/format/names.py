"""The names of the files dcp_fsspec reads and writes, spelled once.

DCP's own (``.metadata``, ``__{rank}_{n}.distcp``), the commit protocol's (``.commit.json`` in
an iteration folder ``iter_000000005``, ``latest_checkpoint.txt`` beside them), and the one
scheme for temporary names: every file written under a temporary name first (local files,
SFTP uploads, the pointer) is ``.{name}.{random}.tmp`` in the final name's folder, so readers,
listings and copies can recognise and skip them with :func:`is_temporary`. And the one rule for a
relative name read from storage (a data file in ``.metadata``, a key listed by a copy): it stays
inside its folder (:func:`relative_path_problem`).
"""

from __future__ import annotations

import posixpath
import re
import uuid

METADATA_NAME = ".metadata"  # DCP's: written last, by the coordinator; its presence commits a key
DATA_SUFFIX = ".distcp"
# An incremental save's content hashes, beside .metadata and written just before it.
CONTENT_HASHES_NAME = ".content_hashes.json"
_CONTENT_HASHES_RE = re.compile(r"(__[0-9]+)?" + re.escape(CONTENT_HASHES_NAME))
COMMIT_RECORD_NAME = ".commit.json"
POINTER_NAME = "latest_checkpoint.txt"
_TEMP_SUFFIX = ".tmp"

ITERATION_PREFIX = "iter_"
ITERATION_DIGITS = 9
# At most 18 digits: every iteration fits an int64, and a name read from storage (the pointer, a
# listing) is never handed to int() at a length where that costs time or raises. ASCII digits
# only: int() would also read other scripts' digits, naming a folder that is not the one found.
MAX_ITERATION_DIGITS = 18
ITERATION_RE = re.compile(rf"{ITERATION_PREFIX}([0-9]{{{ITERATION_DIGITS},{MAX_ITERATION_DIGITS}}})")


def metadata_name(rank: int | None = None) -> str:
    """``.metadata``, or ``__{rank}.metadata`` for saves made without collectives (torch's rule)."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def content_hashes_name(rank: int = 0) -> str:
    """``.content_hashes.json``, or ``__{rank}.content_hashes.json`` for a rank > 0's own.

    A per-node drain uploads every rank's content hashes of a key into one durable folder: each
    under its own name, so that the next drain compares each rank's with its own copy.
    """
    return CONTENT_HASHES_NAME if rank == 0 else f"__{rank}{CONTENT_HASHES_NAME}"


def is_content_hashes(name: str) -> bool:
    """Whether a file name (or path) is one :func:`content_hashes_name` makes."""
    return _CONTENT_HASHES_RE.fullmatch(posixpath.basename(name)) is not None


def data_file_name(prefix: str, n: int) -> str:
    """The ``n``-th data file of a rank whose DCP storage prefix is ``prefix`` (``__0_``)."""
    return f"{prefix}{n}{DATA_SUFFIX}"


def temporary_path(path: str) -> str:
    """A fresh temporary name for ``path``, in the same folder (so a rename is atomic)."""
    folder, name = posixpath.split(path)
    return posixpath.join(folder, f".{name}.{uuid.uuid4().hex[:12]}{_TEMP_SUFFIX}")


def is_temporary(name: str) -> bool:
    """Whether a file name (or path) is one :func:`temporary_path` makes."""
    base = posixpath.basename(name)
    return base.startswith(".") and base.endswith(_TEMP_SUFFIX) and base.count(".") >= 3


def relative_path_problem(name: object) -> str | None:
    """Why ``name``, a path read from storage, could leave the folder it is relative to; ``None`` if it cannot.

    Allowed: ``/``-separated names, none of them empty, ``.`` or ``..``; nothing absolute, no
    scheme or drive (no ``:``), no backslash (a separator on Windows), no NUL.
    """
    if not isinstance(name, str) or not name:
        return "it is not a non-empty string"
    if name.startswith("/"):
        return "it is absolute"
    for char, what in ((":", "a scheme or drive (':')"), ("\\", "a backslash"), ("\0", "a NUL character")):
        if char in name:
            return f"it holds {what}"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "it has an empty, '.' or '..' component"
    return None
