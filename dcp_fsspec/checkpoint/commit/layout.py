"""Where iterations live under ``save_dirname``: folder names, and finding the folders.

An iteration's folder is ``iter_`` and the iteration zero-padded to nine digits
(``iter_000000005``, spelled in :mod:`~dcp_fsspec.storage.format.names`); every key saved with it is a
DCP checkpoint in a subfolder (``iter_000000005/model/``). A per-node local tier holds one ``rank{r}`` folder per rank, each
laid out the same way. This module owns the regexes for those names, torch-free so the tools can
read them. It does not know
what makes a folder *committed* (``commit`` does, from one listing of ``save_dirname``): its
finder returns every folder, committed or not.
"""

from __future__ import annotations

import posixpath
import re

from dcp_fsspec.errors import StorageError
from dcp_fsspec.storage.format.names import ITERATION_DIGITS as _ITERATION_DIGITS
from dcp_fsspec.storage.format.names import ITERATION_PREFIX
from dcp_fsspec.storage.format.names import ITERATION_RE as _ITERATION_RE
from dcp_fsspec.storage.format.names import MAX_ITERATION_DIGITS as _MAX_ITERATION_DIGITS
from dcp_fsspec.storage.transport.urls import Location

# Key names become folder names on every backend, so they stay portable and never collide with
# DCP's hidden ``.metadata`` or with our own hidden files.
_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# A per-node local tier holds one ``rank{r}`` folder per rank on the node (see ``tiers``). The
# name is read back from listings, so its digits are bounded like an iteration's.
_RANK_PREFIX = "rank"
_RANK_RE = re.compile(r"rank(0|[1-9][0-9]{0,8})")


def format_iteration(iteration: int) -> str:
    """The folder name of ``iteration`` (``5`` → ``"iter_000000005"``).

    Raises:
        ValueError: ``iteration`` is negative, not an int, or has more than 18 digits.
    """
    if (
        isinstance(iteration, bool)
        or not isinstance(iteration, int)
        or not 0 <= iteration < 10**_MAX_ITERATION_DIGITS
    ):
        raise ValueError(
            f"iteration must be an int >= 0 of at most {_MAX_ITERATION_DIGITS} digits, got {iteration!r}"
        )
    return f"{ITERATION_PREFIX}{iteration:0{_ITERATION_DIGITS}d}"


def parse_iteration(name: str) -> int | None:
    """The iteration named by a folder name or path (its last component), or ``None`` (also for
    a name too long to be one we write: more than 18 digits)."""
    match = _ITERATION_RE.fullmatch(posixpath.basename(name.rstrip("/")))
    return int(match.group(1)) if match else None


def rank_folder_name(rank: int) -> str:
    """The folder of rank ``rank``'s own local tier under a per-node ``local_dirname``."""
    return f"{_RANK_PREFIX}{rank}"


def parse_rank_folder(name: str) -> int | None:
    """The rank whose per-node local tier a folder named ``name`` is (``"rank3"`` → 3), or None."""
    match = _RANK_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def check_key(key: str) -> str:
    """Return ``key`` if it can be a folder name of a saved key, else raise ValueError."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(
            f"checkpoint key {key!r} cannot be a folder name; use letters, digits, '_', '-', '.' "
            "and do not start with '.' or '-'"
        )
    return key


def iteration_path(root: Location, iteration: int) -> str:
    """The path of ``iteration``'s folder under ``root``."""
    return root.join(format_iteration(iteration))


def key_path(root: Location, iteration: int, key: str) -> str:
    """The path of one saved key (a DCP checkpoint folder) of ``iteration``."""
    return root.join(format_iteration(iteration), key)


def list_iterations(root: Location) -> list[int]:
    """Every iteration that has a folder under ``root``, committed or not, ascending.

    Raises:
        StorageError: listing ``root`` failed for a reason other than it not existing.
    """
    # A listing cached by an earlier call (s3fs caches them) would hide other ranks' writes.
    root.fs.invalidate_cache(root.path)
    try:
        entries = root.fs.ls(root.path, detail=True)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StorageError(f"cannot list checkpoints under {root.url}: {e}") from e
    found = set()
    for entry in entries:
        iteration = parse_iteration(entry["name"])
        if iteration is not None and entry.get("type") == "directory":
            found.add(iteration)
    return sorted(found)
