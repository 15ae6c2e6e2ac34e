"""Cooperative loads: each byte range that several ranks need is read once and broadcast.

The steps, on top of DCP's load:

1. ``.metadata``: rank 0 of the group reads it and broadcasts it (:func:`share_metadata`).
2. ``prepare_global_plan`` (the coordinator, every rank's plan in hand): every record needed by
   two ranks or more is cut into pieces, and each piece is given to one of the ranks that need
   it, the least loaded (:func:`plan_shared_reads`). The pieces go in rounds of bounded size. The
   schedule travels in each rank's plan, so the ranks agree on it before any of them reads.
3. ``read_data`` (every rank, :func:`read_shared`): per round, each rank reads its pieces,
   checks the CRC-32 of each tensor record they hold whole, then the ranks agree on success
   and broadcast the pieces. Every rank enters the same collectives in the same order, carrying
   an error flag: a failure on one rank fails every rank with that rank's error.

Records only one rank needs are read by that rank alone, as without cooperation.
"""

from __future__ import annotations

import pickle
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from inspect import GEN_CLOSED, getgeneratorstate
from typing import Generic, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from dcp_fsspec import errors
from dcp_fsspec.errors import CorruptCheckpointError, DcpFsspecError
from dcp_fsspec.storage.read.fetch import Span, fetch_in_order
from dcp_fsspec.storage.read.record_stream import RecordDecoder, RecordPlace, feed_records
from dcp_fsspec.storage.transport.group_tensors import device_for
from dcp_fsspec.storage.transport.urls import Location

RecordKey = tuple[str, int, int]  # relative path, offset, length


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of one data file (relative path), read by ``reader`` for ``needers``."""

    path: str
    start: int
    end: int
    reader: int
    needers: frozenset[int]

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SharedReads:
    """One rank's part of a cooperative load: its plan's ``storage_data``.

    Attributes:
        rounds: the pieces of every shared record, in rounds; the same on every rank.
        mine: the records this rank needs that come through the exchange.
    """

    rounds: tuple[tuple[Piece, ...], ...]
    mine: frozenset[RecordKey]


def plan_shared_reads(
    plans: list[LoadPlan],
    storage_data: dict[MetadataIndex, _StorageInfo],
    *,
    piece_bytes: int,
    round_bytes: int,
    max_gap: int,
) -> list[LoadPlan]:
    """Every rank's plan, with the shared reads recorded in its ``storage_data``.

    A record is shared when two ranks or more need it. Neighbouring shared records with the same
    ranks are read together, in pieces of at most ``piece_bytes``. Each piece goes to the rank
    among those that need it with the fewest bytes in the current round, then overall; a round
    closes when that rank would read more than ``round_bytes`` in it. Plans are returned as
    they are when nothing is shared.
    """
    needers: dict[RecordKey, set[int]] = defaultdict(set)
    for rank, plan in enumerate(plans):
        for item in plan.items:
            info = storage_data.get(item.storage_index)
            if info is not None:  # a missing entry is raised by that rank's read_data
                needers[(info.relative_path, info.offset, info.length)].add(rank)
    shared = sorted(k for k, ranks in needers.items() if len(ranks) > 1)
    if not shared:
        return plans
    rounds = _rounds(_pieces(shared, needers, piece_bytes, max_gap), len(plans), round_bytes)
    return [
        replace(plan, storage_data=SharedReads(rounds, frozenset(k for k in shared if rank in needers[k])))
        for rank, plan in enumerate(plans)
    ]


def _pieces(
    shared: list[RecordKey], needers: dict[RecordKey, set[int]], piece_bytes: int, max_gap: int
) -> list[tuple[Span, frozenset[int]]]:
    """Runs of neighbouring shared records with the same ranks, merged and cut into pieces."""
    pieces: list[tuple[Span, frozenset[int]]] = []
    run: list[RecordKey] = []

    def close_run() -> None:
        ranks = frozenset(needers[run[0]])
        path, start, end = run[0][0], run[0][1], max(o + n for _, o, n in run)
        for at in range(start, end, piece_bytes):
            pieces.append((Span(path, at, min(at + piece_bytes, end)), ranks))

    for key in shared:
        if run:
            path, last_end = run[-1][0], run[-1][1] + run[-1][2]
            gap = key[1] - last_end
            if key[0] != path or needers[key] != needers[run[0]] or gap > max_gap or gap < 0:
                close_run()
                run = []
        run.append(key)
    if run:
        close_run()
    return pieces


def _rounds(
    pieces: list[tuple[Span, frozenset[int]]], ranks: int, round_bytes: int
) -> tuple[tuple[Piece, ...], ...]:
    rounds: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    in_round = [0] * ranks
    total = [0] * ranks
    for span, needers in pieces:
        reader = min(needers, key=lambda r: (in_round[r], total[r], r))
        if current and in_round[reader] + span.size > round_bytes:
            rounds.append(tuple(current))
            current, in_round = [], [0] * ranks
            reader = min(needers, key=lambda r: (total[r], r))
        current.append(Piece(span.path, span.start, span.end, reader, needers))
        in_round[reader] += span.size
        total[reader] += span.size
    rounds.append(tuple(current))
    return tuple(rounds)


# --- the exchange -----------------------------------------------------------------------------


@dataclass
class NeededRecord(RecordPlace):
    """One stored record and the read items of this rank that need it."""

    items: list[ReadItem] = field(default_factory=list)


R = TypeVar("R", bound=NeededRecord)


def record_fqns(record: NeededRecord) -> str:
    """The entries a record holds, for messages."""
    return ", ".join(repr(fqn) for fqn in sorted({i.storage_index.fqn for i in record.items}))


class Group:
    """Agreement and byte broadcasts over one process group, on the device its backend needs.

    Every method is a collective: every rank of the group calls it, in the same order.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = device_for(group)

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank passes an error: the lowest failing rank's.

        The failing rank raises its own exception; the others raise the same class of our
        error tree with the same message.
        """
        flag = torch.tensor(
            [self.rank if error is not None else self.size], dtype=torch.int64, device=self.device
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        source = int(flag.item())
        if source == self.size:
            return
        told = self.broadcast_bytes(_describe(error) if source == self.rank else b"", source)
        if error is not None and source == self.rank:
            raise error
        raise _rebuild(told, source)

    def broadcast_bytes(self, data: bytes | bytearray, source: int, size: int | None = None) -> memoryview:
        """``data`` of rank ``source`` (a group rank), on every rank; ``size``: known to all."""
        if size is None:
            length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            self._broadcast(length, source)
            size = int(length.item())
        if size == 0:
            return memoryview(b"")
        if self.rank == source:
            buffer = data if isinstance(data, bytearray) else bytearray(data)
            self._broadcast(torch.frombuffer(buffer, dtype=torch.uint8).to(self.device), source)
            return memoryview(buffer)
        tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._broadcast(tensor, source)
        return tensor.cpu().numpy().data

    def _broadcast(self, tensor: torch.Tensor, source: int) -> None:
        src = dist.get_global_rank(self.group, source) if self.group is not None else source
        dist.broadcast(tensor, src=src, group=self.group)


def _describe(error: BaseException | None) -> bytes:
    return f"{type(error).__name__}\n{error}".encode()


def _rebuild(told: memoryview, source: int) -> DcpFsspecError:
    """The error rank ``source`` described: the same class of our tree, else DcpFsspecError."""
    name, _, message = bytes(told).decode(errors="replace").partition("\n")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, DcpFsspecError):
        return cls(message)
    return DcpFsspecError(f"rank {source} failed: {name}: {message}")


def share_metadata(
    read: Callable[[], Metadata], parse: Callable[[bytes], Metadata], group: Group
) -> Metadata:
    """``.metadata``, read by rank 0 of ``group`` and broadcast; the others ``parse`` its bytes.

    Raises: on every rank, what ``read`` raised on rank 0.
    """
    metadata: Metadata | None = None
    error: BaseException | None = None
    if group.rank == 0:
        try:
            metadata = read()
        except DcpFsspecError as e:
            error = e
    group.agree(error)
    data = group.broadcast_bytes(pickle.dumps(metadata) if metadata is not None else b"", 0)
    return metadata if metadata is not None else parse(bytes(data))


def read_shared(
    shared: SharedReads,
    group: Group,
    location: Location,
    records: Callable[[], list[R]],
    decoder: Callable[[R], RecordDecoder],
    to_error: Callable[[Exception], Exception],
    *,
    window_bytes: int,
    threads: int,
) -> list[R]:
    """Load the shared records of this rank's plan through the exchange.

    Args:
        shared: the plan's :class:`SharedReads`.
        group: the ranks of the load (those whose plans made ``shared``).
        location: the checkpoint.
        records: this rank's records (may raise: the error is then carried to every rank).
        decoder: the decoder that delivers a record to its targets.
        to_error: the error of ours a failure of this rank's reads or decoders is raised as.
        window_bytes: downloaded data held at once by this rank's own reads.
        threads: concurrent reads on filesystems without an async API.

    Returns:
        The records this rank reads alone.

    Raises:
        On every rank, the first failing rank's error.
    """
    exchange = _Exchange(
        shared, group, location, decoder, to_error, window_bytes=window_bytes, threads=threads
    )
    try:
        everything = records()
    except Exception as e:  # noqa: BLE001 - carried into the exchange, which raises it on every rank
        exchange.error = to_error(e)
        everything = []
    mine = {(location.join(path), offset, length) for path, offset, length in shared.mine}
    alone = [r for r in everything if (r.path, r.offset, r.length) not in mine]
    exchange.run(
        sorted(
            (r for r in everything if (r.path, r.offset, r.length) in mine), key=lambda r: (r.path, r.offset)
        )
    )
    return alone


class _Exchange(Generic[R]):
    def __init__(
        self,
        shared: SharedReads,
        group: Group,
        location: Location,
        decoder: Callable[[R], RecordDecoder],
        to_error: Callable[[Exception], Exception],
        *,
        window_bytes: int,
        threads: int,
    ) -> None:
        self.shared = shared
        self.group = group
        self.location = location
        self.decoder = decoder
        self.to_error = to_error
        self.window_bytes = window_bytes
        self.threads = threads
        self.error: Exception | None = None
        self.records: list[R] = []
        self._starts: list[tuple[str, int]] = []  # each record's (path, offset), to find them by span
        self.decoders: dict[int, RecordDecoder] = {}

    def run(self, records: list[R]) -> None:
        """Feed ``records`` (sorted) from the rounds; every rank runs every round."""
        self.records = records
        self._starts = [(r.path, r.offset) for r in records]
        received = self._rounds()
        try:
            # feed_records views each piece's bytes; a received piece is a view already.
            feed_records(records, cast(Iterable[tuple[Span, bytes]], received), self._start)
        except Exception as e:
            if getgeneratorstate(received) == GEN_CLOSED:
                raise  # the agreed error
            self.error = self.error or self.to_error(e)
            for _ in received:  # the remaining collectives; the next agreement raises
                pass

    def _start(self, i: int) -> RecordDecoder:
        decoder = self.decoders[i] = self.decoder(self.records[i])
        return decoder

    def _rounds(self) -> Generator[tuple[Span, memoryview], None, None]:
        me = self.group.rank
        for pieces in self.shared.rounds:
            mine = [p for p in pieces if p.reader == me]
            data: dict[Piece, bytes | bytearray] = {}
            if self.error is None and mine:
                try:
                    data = self._read(mine)
                except Exception as e:  # noqa: BLE001 - every rank raises it at the agreement
                    self.error = self.to_error(e)
            self.group.agree(self.error)
            for piece, view in self._broadcast(pieces, data):
                yield Span(self.location.join(piece.path), piece.start, piece.end), view
        if self.error is None:
            self.error = self._incomplete()
        self.group.agree(self.error)

    def _read(self, pieces: list[Piece]) -> dict[Piece, bytes | bytearray]:
        """Read this rank's pieces of a round and check the tensor records they hold whole."""
        spans = [Span(self.location.join(p.path), p.start, p.end) for p in pieces]
        data: dict[Piece, bytes | bytearray] = {}
        fetched = fetch_in_order(
            self.location.fs,
            spans,
            window_bytes=self.window_bytes,
            threads=self.threads,
            retry=self.location.retry,
        )
        for piece, (span, got) in zip(pieces, fetched):
            if len(got) != span.size:
                raise CorruptCheckpointError(
                    f"{self.location.url_of(span.path)!r} is truncated: needed bytes [{span.start}, {span.end}) "
                    f"but got {len(got)}; restore it or load another checkpoint"
                )
            data[piece] = got
        self._check_whole_records(spans, [data[p] for p in pieces])
        return data

    def _check_whole_records(self, spans: list[Span], data: list[bytes | bytearray]) -> None:
        """Check the CRC-32 of every tensor record that lies whole in one of ``spans``, before
        its bytes go to other ranks (the others check again as they decode)."""
        for span, got in zip(spans, data):
            first = bisect_left(self._starts, (span.path, span.start))
            inside = []
            for record in self.records[first:]:
                if record.path != span.path or record.offset >= span.end:
                    break
                if record.end <= span.end:
                    inside.append(record)
            # max_whole=0: a record without a tensor header (an object, a compressed record) is
            # never held here; its readers judge it.
            checks = [RecordDecoder(record, max_whole=0) for record in inside]
            feed_records(inside, [(span, got)], checks.__getitem__)
            for record, check in zip(inside, checks):
                fault = check.check_streamed() if check.fault is None and check.layout is not None else None
                if fault is not None:
                    raise fault.exception(record, record_fqns(record))

    def _broadcast(
        self, pieces: Sequence[Piece], data: dict[Piece, bytes | bytearray]
    ) -> Iterator[tuple[Piece, memoryview]]:
        """Every piece of the round, broadcast by its reader; yields those this rank needs, in order."""
        by_reader: dict[int, list[Piece]] = defaultdict(list)
        for piece in pieces:
            by_reader[piece.reader].append(piece)
        views: dict[Piece, memoryview] = {}
        for reader in sorted(by_reader):
            own = by_reader[reader]
            size = sum(p.size for p in own)
            out = bytearray()
            if reader == self.group.rank:
                out = bytearray(size)
                at = 0
                for piece in own:
                    out[at : at + piece.size] = data[piece]
                    at += piece.size
            view = self.group.broadcast_bytes(out, reader, size)
            at = 0
            for piece in own:
                if self.group.rank in piece.needers:
                    views[piece] = view[at : at + piece.size]
                at += piece.size
        for piece in pieces:
            if piece in views:
                yield piece, views[piece]

    def _incomplete(self) -> Exception | None:
        for i, record in enumerate(self.records):
            decoder = self.decoders.get(i)
            if decoder is None or not decoder.done:
                return CorruptCheckpointError(
                    f"{record.url!r} at bytes [{record.offset}, {record.end}) ({record_fqns(record)}) did not "
                    "arrive whole through the exchange; load again, or load with cooperative=False"
                )
        return None
