"""A folder's files sent to another rank over a process group, each CRC-32-checked on arrival.

The wire, per transfer: a header (the files' names and sizes, and what they are a copy of),
then the bytes in pieces of at most :data:`PIECE_BYTES`, then each file's CRC-32 and whether the
sender read every byte. A rank may send one folder and receive another at once (both directions
of a pair, or a ring): each piece goes out and comes in together, so memory stays two pieces.
The group is the replicas' own, so these never meet training's collectives. The tensors are on
the CPU: gloo carries them whatever device training uses.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dcp_fsspec.checkpoint.tiers.replica_files import check_name
from dcp_fsspec.errors import CorruptCheckpointError, DcpFsspecError, StorageError
from dcp_fsspec.storage.format.crc import crc32
from dcp_fsspec.storage.transport.urls import Location

PIECE_BYTES = 16 * 1024 * 1024
# A header names a folder's files: a few hundred bytes each. Anything far bigger is no header of ours.
_MAX_HEADER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Folder:
    """Files below ``root``, by ``/``-separated relative name and size, in the order they go."""

    root: Location
    files: tuple[tuple[str, int], ...]
    about: dict[str, Any] = field(default_factory=dict)
    # Each file's CRC-32 when it is known beforehand (a replica's manifest): sent as the one to check.
    crcs: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Arrived:
    """What a transfer wrote: the files, their CRC-32s (each checked), and the sender's ``about``."""

    files: tuple[tuple[str, int], ...]
    crcs: tuple[int, ...]
    about: dict[str, Any]


def exchange(
    group: dist.ProcessGroup, send: tuple[int, Folder] | None, receive: tuple[int, Location] | None
) -> Arrived | None:
    """Send ``send``'s folder to its rank, and receive the folder a rank sends into a folder, at once.

    Args:
        group: the group of the transfer; ranks are its group ranks.
        send: ``(rank, folder)`` to send, or None.
        receive: ``(rank, folder)``: receive what that rank sends into that folder, or None.

    Returns:
        What arrived, every file's CRC-32 checked; None when nothing was to be received.

    Raises:
        CorruptCheckpointError: a file arrived with another CRC-32 than the sender's, or the
            sender could not read it (the receiver's folder then holds those bytes: it is not
            committed, the caller removes it).
    """
    out_header = None if send is None else _header(send[1])
    in_header = _swap_bytes(group, send, receive, out_header)
    files = () if in_header is None else _files_of(in_header, receive)
    sending = [] if send is None else list(send[1].files)
    reading = _Reading()
    reader = _pieces(send[1], sending, reading) if send is not None else iter(())
    writer = _Writer(receive[1], files) if receive is not None else None
    dst = -1 if send is None else send[0]
    src = -1 if receive is None else receive[0]
    outgoing_pieces = _piece_sizes(sending)
    incoming_pieces = _piece_sizes(list(files))
    for i in range(max(len(outgoing_pieces), len(incoming_pieces))):
        works = []
        if i < len(outgoing_pieces):
            works.append(dist.isend(next(reader), group=group, group_dst=dst))
        piece = None
        if i < len(incoming_pieces):
            piece = torch.empty(incoming_pieces[i], dtype=torch.uint8)
            works.append(dist.irecv(piece, group=group, group_src=src))
        for work in works:
            work.wait()
        if piece is not None and writer is not None:
            writer.write(piece)
    sent_crcs = None if send is None else _trailer(send[1], reader, reading)
    received = _swap_trailer(group, send, receive, sent_crcs, len(files))
    if writer is None or in_header is None:
        return None
    crcs = writer.finish(received)
    return Arrived(files, crcs, dict(in_header.get("about") or {}))


def _header(folder: Folder) -> bytes:
    return json.dumps({"files": [list(f) for f in folder.files], "about": folder.about}).encode()


def _swap_bytes(
    group: dist.ProcessGroup,
    send: tuple[int, Folder] | None,
    receive: tuple[int, Location] | None,
    out_header: bytes | None,
) -> dict[str, Any] | None:
    """Send our header and receive theirs: first their lengths, then their bytes."""
    in_length = torch.zeros(1, dtype=torch.int64)
    _both(
        group,
        None if send is None else (send[0], torch.tensor([len(out_header or b"")], dtype=torch.int64)),
        None if receive is None else (receive[0], in_length),
    )
    length = int(in_length.item())
    if receive is not None and not 0 < length <= _MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"rank {receive[0]} announced a header of {length} bytes for {receive[1].url}: not one of ours"
        )
    in_bytes = torch.empty(length if receive is not None else 0, dtype=torch.uint8)
    _both(
        group,
        None
        if send is None
        else (send[0], torch.frombuffer(bytearray(out_header or b""), dtype=torch.uint8)),
        None if receive is None else (receive[0], in_bytes),
    )
    if receive is None:
        return None
    try:
        header = json.loads(in_bytes.numpy().tobytes())
    except ValueError as e:
        raise CorruptCheckpointError(
            f"the header rank {receive[0]} sent for {receive[1].url} is not JSON"
        ) from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(
            f"the header rank {receive[0]} sent for {receive[1].url} is not an object"
        )
    return header


def _files_of(header: dict[str, Any], receive: tuple[int, Location] | None) -> tuple[tuple[str, int], ...]:
    assert receive is not None
    listed = header.get("files")
    if not isinstance(listed, list):
        raise CorruptCheckpointError(f"the header rank {receive[0]} sent for {receive[1].url} lists no files")
    files = []
    for entry in listed:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], int) and entry[1] >= 0):
            raise CorruptCheckpointError(
                f"the header rank {receive[0]} sent for {receive[1].url} holds {entry!r}, not a name and a size"
            )
        files.append((check_name(entry[0]), entry[1]))
    return tuple(files)


def _both(
    group: dist.ProcessGroup,
    send: tuple[int, torch.Tensor] | None,
    receive: tuple[int, torch.Tensor] | None,
) -> None:
    works = []
    if send is not None and send[1].numel():
        works.append(dist.isend(send[1], group=group, group_dst=send[0]))
    if receive is not None and receive[1].numel():
        works.append(dist.irecv(receive[1], group=group, group_src=receive[0]))
    for work in works:
        work.wait()


def _piece_sizes(files: Sequence[tuple[str, int]]) -> list[int]:
    return [min(PIECE_BYTES, size - at) for _, size in files for at in range(0, size, PIECE_BYTES)]


class _Reading:
    """What a sender learnt while reading: each file's CRC-32, and whether every read succeeded."""

    def __init__(self) -> None:
        self.crcs: list[int] = []
        self.ok = True


def _pieces(folder: Folder, files: Sequence[tuple[str, int]], reading: _Reading) -> Iterator[torch.Tensor]:
    """Each piece of ``files`` in order; a file that cannot be read goes as zeros (the receiver
    is told in the trailer: its bytes never count)."""
    for name, size in files:
        crc = 0
        try:
            handle = folder.root.fs.open(posixpath.join(folder.root.path, name), "rb")
        except (OSError, DcpFsspecError):
            handle = None
            reading.ok = False
        try:
            for at in range(0, size, PIECE_BYTES):
                piece = torch.zeros(min(PIECE_BYTES, size - at), dtype=torch.uint8)
                if handle is not None:
                    view = memoryview(piece.numpy())
                    try:
                        got = handle.readinto(view)
                    except (OSError, DcpFsspecError):
                        got = -1
                    if got != len(view):
                        reading.ok = False
                    crc = crc32(view, crc)
                yield piece
        finally:
            if handle is not None:
                handle.close()
        reading.crcs.append(crc)


def _trailer(folder: Folder, reader: Iterator[torch.Tensor], reading: _Reading) -> list[int]:
    """The CRC-32s to send after the bytes, then a last entry: 1 if every byte was read, else 0."""
    for _ in reader:  # a folder of empty files yields no piece: run the reader to its end
        pass
    computed = reading.crcs + [0] * (len(folder.files) - len(reading.crcs))
    crcs = list(folder.crcs) if folder.crcs is not None else computed
    # A replica whose bytes no longer match its manifest's CRC-32s arrives refused: the receiver
    # compares what arrived with the manifest's.
    return [*crcs, int(reading.ok)]


def _swap_trailer(
    group: dist.ProcessGroup,
    send: tuple[int, Folder] | None,
    receive: tuple[int, Location] | None,
    crcs: list[int] | None,
    n_in: int,
) -> list[int]:
    incoming = torch.zeros(n_in + 1, dtype=torch.int64)
    _both(
        group,
        None if send is None else (send[0], torch.tensor(crcs, dtype=torch.int64)),
        None if receive is None else (receive[0], incoming),
    )
    return [int(v) for v in incoming.tolist()]


class _Writer:
    """Writes arriving pieces into their files in order, a CRC-32 running over each.

    A write that fails is remembered, and the pieces still arriving are drained: the sender
    goes on to its trailer, so the next transfer between the two ranks starts in step.
    """

    def __init__(self, root: Location, files: tuple[tuple[str, int], ...]) -> None:
        self._root = root
        self._files = list(files)
        self._crcs: list[int] = []
        self._index = -1
        self._left = 0
        self._crc = 0
        self._handle: Any = None
        self._error: Exception | None = None
        self._next_file()

    def _next_file(self) -> None:
        """Close the file done; open the next ones (empty files are written whole here)."""
        while self._left == 0:
            self._close()
            self._index += 1
            if self._index >= len(self._files):
                return
            name, size = self._files[self._index]
            self._left, self._crc = size, 0
            if self._error is None:
                path = posixpath.join(self._root.path, name)
                try:
                    self._root.fs.makedirs(posixpath.dirname(path), exist_ok=True)
                    self._handle = self._root.fs.open(path, "wb")
                except OSError as e:
                    self._error = e

    def _close(self) -> None:
        if self._index >= 0 and self._index < len(self._files):
            self._crcs.append(self._crc)
        if self._handle is not None:
            try:
                self._handle.close()
            except OSError as e:
                self._error = self._error or e
            self._handle = None

    def write(self, piece: torch.Tensor) -> None:
        view = memoryview(piece.numpy())
        if self._handle is not None and self._error is None:
            try:
                self._handle.write(view)
            except OSError as e:
                self._error = e
        self._crc = crc32(view, self._crc)
        self._left -= len(view)
        self._next_file()

    def finish(self, trailer: list[int]) -> tuple[int, ...]:
        """Check every file's CRC-32 against the sender's; return them.

        Raises:
            StorageError: a file could not be written here.
            CorruptCheckpointError: naming the first file whose bytes differ, or that the sender
                could not read.
        """
        if self._error is not None:
            raise StorageError(f"could not write the copy arriving into {self._root.url}: {self._error}")
        *expected, ok = trailer
        if not ok:
            raise CorruptCheckpointError(
                f"the sender of {self._root.url} could not read every file: the copy there is not used"
            )
        for (name, _), got, want in zip(self._files, self._crcs, expected, strict=True):
            if got != want:
                raise CorruptCheckpointError(
                    f"{self._root.url_of(posixpath.join(self._root.path, name))} arrived with CRC-32 "
                    f"{got:#010x}, not the sender's {want:#010x}: the copy there is not used"
                )
        return tuple(self._crcs)
