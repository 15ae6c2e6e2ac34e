"""Where each rank's share of the iteration ``load`` resumes comes from: its own copy, a peer's
replica, or the durable tier. A pure function of what every rank reported, the same on every rank.

The iteration is the newest one whose every share is available from one of the three sources,
as one save (one token). The durable tier is asked only when the local copies and replicas do
not cover every share of the newest iteration they hold: it receives nothing but drains of
local saves, so it is never newer than the copies that cover every share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

OWN = "local"
PEER = "peer"
DURABLE = "durable"


@dataclass(frozen=True)
class DurableFacts:
    """What rank 0 read of the durable tier: its pointer, and the tokens of some iterations there."""

    latest: int | None
    tokens: Mapping[int, str | None]


@dataclass(frozen=True)
class Source:
    """One rank's source: ``OWN``, ``PEER`` (from ``holder``) or ``DURABLE``."""

    kind: str
    holder: int | None = None


@dataclass(frozen=True)
class Shares:
    """The iteration resumed, its save's token, and each rank's source."""

    iteration: int
    token: str
    sources: tuple[Source, ...]

    def ranks(self, kind: str) -> list[int]:
        return [r for r, s in enumerate(self.sources) if s.kind == kind]


class NeedDurable(Exception):
    """The local copies do not cover every share: rank 0 must read these durable iterations."""

    def __init__(self, iterations: list[int]) -> None:
        super().__init__(iterations)
        self.iterations = iterations


def plan_shares(
    own: Sequence[Mapping[int, str | None]],
    held: Sequence[Mapping[tuple[int, int], str]],
    durable: DurableFacts | None,
    *,
    iteration: int | None = None,
) -> Shares | None:
    """Each rank's source for the newest iteration every share is available of; None: no such
    iteration in the local tiers (read the durable tier as without replicas).

    Args:
        own: for each rank, its committed local iterations and their tokens.
        held: for each rank, the replicas it holds and checked, ``(src, iteration) -> token``.
        durable: what the durable tier holds; None while unread.
        iteration: the iteration asked for, if any.

    Raises:
        NeedDurable: the durable tier must be read to decide (``durable`` is None).
    """
    holders: dict[tuple[int, int, str], list[int]] = {}
    for holder, replicas in enumerate(held):
        for (src, it), token in replicas.items():
            holders.setdefault((src, it, token), []).append(holder)
    candidates = {(i, t) for mine in own for i, t in mine.items() if t is not None}
    candidates |= {(i, t) for (_, i, t) in holders}
    if iteration is not None:
        candidates = {(i, t) for i, t in candidates if i == iteration}

    def covered(i: int, t: str) -> int:
        return sum(own[r].get(i) == t or (r, i, t) in holders for r in range(len(own)))

    ordered = sorted(candidates, key=lambda c: (-c[0], -covered(*c), c[1]))
    for i, t in ordered:
        if durable is not None and durable.latest is not None and durable.latest > i and iteration is None:
            return None  # the durable tier is newer: read it as without replicas
        sources = []
        for r in range(len(own)):
            if own[r].get(i) == t:
                sources.append(Source(OWN))
            elif (r, i, t) in holders:
                sources.append(Source(PEER, holders[(r, i, t)][0]))
            elif durable is not None and durable.tokens.get(i) == t:
                sources.append(Source(DURABLE))
            else:
                break
        else:
            return Shares(i, t, tuple(sources))
        if durable is None:
            raise NeedDurable(sorted({c[0] for c in ordered}, reverse=True))
    return None
