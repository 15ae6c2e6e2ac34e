"""How many requests one process sends a store at once, adapted to the store's throttling.

Each filesystem gets one :class:`AdaptiveLimit` (:func:`store_limit`), shared by its uploads
and its ranged reads. When the store throttles (``503 SlowDown``), the limit halves; after a
run of successes it grows back by one. Fewer requests then wait out the throttling, so retries
do not multiply the load (AIMD, as TCP does with its window).

A request holds a :class:`Ticket` while it runs. A throttled request halves the limit only if
no other halving came since it started: requests sent together under the old limit, throttled
together, halve it once. A driver that retries inside one call (botocore) reports each
throttled answer through :func:`throttled_now`, which finds the request's ticket in its context.
"""

from __future__ import annotations

import asyncio
import contextvars
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# High enough never to bind before the store throttles: the byte budgets, the read window and
# the driver's connection pool bound the requests of a process until then.
CEILING = 1024
# Successes that add one request to a throttled limit: it grows back slowly.
GROW_AFTER = 8

_LIMITS: weakref.WeakKeyDictionary[Any, AdaptiveLimit] = weakref.WeakKeyDictionary()
_CURRENT: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("dcp_fsspec_ticket", default=None)


class Ticket:
    """One request's place under the limit, from its start to its answer (``limit=None``: a
    request under no limit, which only notes whether it was throttled)."""

    def __init__(self, limit: AdaptiveLimit | None = None) -> None:
        self.limit = limit
        self.epoch = 0 if limit is None else limit.epoch
        self.throttled = False

    def throttle(self) -> None:
        """The store throttled this request (once or many times: it counts once)."""
        if not self.throttled:
            self.throttled = True
            if self.limit is not None:
                self.limit._throttled(self)


class AdaptiveLimit:
    """The requests one process may have in flight to one store: halved on throttling, grown
    back by one every ``grow_after`` successes, between 1 and ``ceiling``.

    Used from one event loop (the filesystem's). :meth:`try_acquire` and :meth:`release` are
    the whole policy; :meth:`acquire` waits for a place.
    """

    def __init__(self, ceiling: int = CEILING, grow_after: int = GROW_AFTER) -> None:
        self.ceiling = max(1, ceiling)
        self.grow_after = max(1, grow_after)
        self.limit = self.ceiling
        self.in_flight = 0
        self.epoch = 0  # halvings so far
        self._successes = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_acquire(self) -> Ticket | None:
        """A ticket if a request may start now, else None."""
        if self.in_flight >= self.limit:
            return None
        self.in_flight += 1
        return Ticket(self)

    async def acquire(self) -> Ticket:
        """A ticket, once a request may start (first come, first served)."""
        if not self._waiters and (ticket := self.try_acquire()) is not None:
            return ticket
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        try:
            while True:
                await waiter
                if (ticket := self.try_acquire()) is not None:
                    return ticket
                waiter = loop.create_future()
                self._waiters.appendleft(waiter)
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self._wake()  # a waiter woken, then cancelled, passes its place on

    def release(self, ticket: Ticket) -> None:
        """The request ended; a success counts towards growing the limit back."""
        self.in_flight -= 1
        if not ticket.throttled:
            self._successes += 1
            if self._successes >= self.grow_after and self.limit < self.ceiling:
                self.limit += 1
                self._successes = 0
        self._wake()

    def _throttled(self, ticket: Ticket) -> None:
        self._successes = 0
        if ticket.epoch == self.epoch:  # not yet halved for the requests sent with this one
            self.limit = max(1, min(self.limit, self.in_flight) // 2)
            self.epoch += 1

    def _wake(self) -> None:
        """Wake as many waiters as there are free places."""
        free = self.limit - self.in_flight
        while free > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1


def store_limit(fs: Any) -> AdaptiveLimit:
    """The limit shared by every request of this process to ``fs``'s store."""
    limit = _LIMITS.get(fs)
    if limit is None:
        limit = _LIMITS[fs] = AdaptiveLimit()
    return limit


def current_ticket() -> Ticket | None:
    """The ticket of the request running in this context (None outside one)."""
    return _CURRENT.get()


@contextmanager
def running(ticket: Ticket | None) -> Iterator[None]:
    """``ticket`` is the current request's while the block runs (for :func:`throttled_now`)."""
    token = _CURRENT.set(ticket)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def throttled_now() -> None:
    """The store throttled the request running in this context (a driver's retry saw it)."""
    ticket = _CURRENT.get()
    if ticket is not None:
        ticket.throttle()
