"""References: a record that one checkpoint of a run finds in another checkpoint of the same run.

An incremental save (:mod:`~dcp_fsspec.storage.format.content_hashes`) does not write again a record its base holds. Its
``.metadata`` names that record's file by a relative path that leaves the folder in one of two
shapes, and in no other:

1. ``../<sibling>/<file>``: a checkpoint folder beside this one (``run/step-10`` for ``run/step-20``).
2. ``../../iter_<digits>/<key>/<file>``: the same key of another iteration, where this folder is
   a key of an iteration (``run/iter_000000010/model`` for ``run/iter_000000020/model``).

A reference never leads further: the save that makes one from its base's own reference copies
that reference. Readers follow the second shape; the first only when told (``references=True``).
Every other path read from storage stays inside its folder (:mod:`~dcp_fsspec.storage.format.names`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from dcp_fsspec.storage.format.names import ITERATION_RE, relative_path_problem

_UP = "../"


def is_reference(name: str) -> bool:
    """Whether a data file name from ``.metadata`` names a file of another checkpoint."""
    return name.startswith(_UP)


def reference_problem(name: str, folder: str, *, siblings: bool = True) -> str | None:
    """Why ``name``, read from the ``.metadata`` of the checkpoint at ``folder``, is not a
    reference of one of the two allowed shapes; ``None`` if it is one.

    ``folder`` is the checkpoint's path (or URL): its last two components decide what may be
    named. ``siblings``: the first shape is allowed too (a plain layout has no commit record to
    say which folders belong to the run, so its reader must be told to follow them).
    """
    parts = name.split("/")
    depth = 0
    while depth < len(parts) and parts[depth] == "..":
        depth += 1
    rest = parts[depth:]
    problem = relative_path_problem("/".join(rest))
    if problem is not None:
        return problem
    own = [p for p in _path_of(folder).split("/") if p]
    if depth not in (1, 2) or len(rest) != depth + 1 or len(own) <= depth:
        return "it leaves the folder other than to a sibling checkpoint ('../step/file') or another iteration's same key ('../../iter_N/key/file')"
    if rest[0] == own[-depth]:
        return "it names this checkpoint's own folder from outside"
    if depth == 1 and not siblings:
        return (
            f"it names a file of the sibling checkpoint {_resolved(folder, posixpath.dirname(name))} (an "
            "incremental save's base); pass references=True (--references in the CLI) to follow it"
        )
    if depth == 2 and not (
        rest[1] == own[-1] and ITERATION_RE.fullmatch(rest[0]) and ITERATION_RE.fullmatch(own[-2])
    ):
        return "two levels up it may only name the same key of another iteration ('../../iter_N/key/file')"
    return None


def reference_prefix(folder: str, base: str) -> str | None:
    """The relative path from the checkpoint at ``folder`` to ``base``'s folder, ending in ``/``,
    if ``base`` is a checkpoint it may refer to (a sibling, or the same key of another iteration);
    else ``None``."""
    own = [p for p in _path_of(folder).split("/") if p]
    other = [p for p in _path_of(base).split("/") if p]
    for depth in (1, 2):
        prefix = _UP * depth + "/".join(other[-depth:]) + "/"
        if (
            len(own) == len(other)
            and own[:-depth] == other[:-depth]
            and reference_problem(prefix + "f", folder) is None
        ):
            return prefix
    return None


def referenced_folders(names: Iterable[str]) -> set[str]:
    """The folders (relative, ``../…``) of the references among data file ``names``."""
    return {posixpath.dirname(name) for name in names if is_reference(name)}


def _path_of(url_or_path: str) -> str:
    """The path part of a URL (the bucket included), or the path itself."""
    return url_or_path.split("://", 1)[-1]


def _resolved(folder: str, name: str) -> str:
    """``name`` (relative, with ``..``) joined to ``folder`` (a path or URL), for a message."""
    scheme, sep, path = folder.rpartition("://")
    return f"{scheme}{sep}{posixpath.normpath(posixpath.join(path, name))}"
