"""Replicas on a node's disk: where they sit, and their manifest. Torch-free, for ``ls``.

Per node, rank ``r`` holds the copies it received under ``{dirname}/rank{r}/replicas/rank{src}/iter_…/``:
the files of ``src``'s committed local iteration, and last a manifest, ``.replica.json`` (each
file's name, size and CRC-32; the save's token; the world size). The manifest commits the
replica. Its bytes come from disk: they are parsed as untrusted, bounded, every field checked.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.errors import CorruptCheckpointError, DcpFsspecError
from dcp_fsspec.storage.transport.urls import Location

logger = logging.getLogger(__name__)

REPLICAS_FOLDER = "replicas"
MANIFEST_NAME = ".replica.json"
_MANIFEST_FORMAT = 1
_MAX_MANIFEST_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Replica:
    """A committed replica, as its manifest says: whose share, which save, which files."""

    src: int
    iteration: int
    token: str
    world_size: int
    files: tuple[tuple[str, int], ...]
    crcs: tuple[int, ...]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": _MANIFEST_FORMAT,
                "src": self.src,
                "iteration": self.iteration,
                "token": self.token,
                "world_size": self.world_size,
                "files": [[n, s, c] for (n, s), c in zip(self.files, self.crcs, strict=True)],
            },
            indent=1,
        ).encode()


def replicas_of(local: Location, src: int) -> Location:
    """Where this rank's local tier ``local`` keeps the replicas of rank ``src``."""
    return local.at(local.join(REPLICAS_FOLDER, layout.rank_folder_name(src)))


def replica_folder(local: Location, src: int, iteration: int) -> Location:
    """The folder of rank ``src``'s replica of ``iteration``."""
    held = replicas_of(local, src)
    return held.at(layout.iteration_path(held, iteration))


def parse_manifest(raw: bytes, url: str) -> Replica:
    """A manifest's bytes (untrusted: bounded, every field checked).

    Raises:
        CorruptCheckpointError: naming ``url``, when the bytes are not a manifest we wrote.
    """
    try:
        if len(raw) > _MAX_MANIFEST_BYTES:
            raise ValueError(f"{len(raw)} bytes")
        doc = json.loads(raw)
        files = tuple((check_name(n), _count(s)) for n, s, _ in doc["files"])
        crcs = tuple(_count(c) for _, _, c in doc["files"])
        replica = Replica(
            _count(doc["src"]),
            _count(doc["iteration"]),
            str(doc["token"]),
            _count(doc["world_size"]),
            files,
            crcs,
        )
        if doc["format"] != _MANIFEST_FORMAT:
            raise ValueError(f"format {doc['format']!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{url} is not a replica manifest ({e}); the replica is not used") from e
    return replica


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def held_replicas(local: Location) -> dict[tuple[int, int], Replica]:
    """The committed replicas this rank holds, by ``(src, iteration)``: one listing, one read of
    each manifest. A replica whose manifest is damaged is skipped, logged."""
    root = local.join(REPLICAS_FOLDER)
    held: dict[tuple[int, int], Replica] = {}
    try:
        found = local.backend.find(root)
    except (OSError, DcpFsspecError) as e:
        logger.warning("cannot list the replicas under %s (%s): none is used", local.url_of(root), e)
        return held
    for path in sorted(found):
        parts = path[len(root.rstrip("/")) + 1 :].split("/")
        if len(parts) != 3 or parts[2] != MANIFEST_NAME:
            continue
        src, iteration = layout.parse_rank_folder(parts[0]), layout.parse_iteration(parts[1])
        if src is None or iteration is None:
            continue
        try:
            with local.fs.open(path, "rb") as f:
                replica = parse_manifest(f.read(_MAX_MANIFEST_BYTES + 1), local.url_of(path))
            if (replica.src, replica.iteration) != (src, iteration):
                raise CorruptCheckpointError(
                    f"{local.url_of(path)} describes rank {replica.src}'s iteration {replica.iteration}, "
                    "not the folder it is in; the replica is not used"
                )
        except (OSError, DcpFsspecError) as e:
            logger.warning("%s", e)
            continue
        held[(src, iteration)] = replica
    return held


def check_name(name: object) -> str:
    """``name`` if it is a relative path that stays below its folder, else CorruptCheckpointError."""
    if (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or "\\" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise CorruptCheckpointError(f"a replica names the file {name!r}, which is not below its folder")
    return name


@dataclass(frozen=True)
class ReplicaFolder:
    """A replica folder as ``ls`` shows it: whose share, which iteration, committed, its size."""

    src: int
    iteration: int
    url: str
    committed: bool
    size_bytes: int


def replica_folders(local: Location) -> list[ReplicaFolder]:
    """Every replica folder under this rank's local tier, committed (a manifest) or not: one listing."""
    root = local.join(REPLICAS_FOLDER)
    found: dict[tuple[int, int], list[int]] = {}
    for path, info in local.backend.find(root).items():
        parts = path[len(root.rstrip("/")) + 1 :].split("/")
        src = layout.parse_rank_folder(parts[0]) if len(parts) > 2 else None
        iteration = layout.parse_iteration(parts[1]) if len(parts) > 2 else None
        if src is None or iteration is None:
            continue
        entry = found.setdefault((src, iteration), [0, 0])
        entry[0] += int(info.get("size") or 0)
        entry[1] |= parts[2:] == [MANIFEST_NAME]
    return [
        ReplicaFolder(src, it, replica_folder(local, src, it).url, bool(committed), size)
        for (src, it), (size, committed) in sorted(found.items())
    ]
