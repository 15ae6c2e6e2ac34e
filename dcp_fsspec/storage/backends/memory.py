"""``memory://``: fsspec's in-process store. Generic behaviour, but another process cannot see
it, so asynchronous saves run in a thread instead of a background process."""

from __future__ import annotations

from .base import Backend


class MemoryBackend(Backend):
    name = "memory://"
    shared_across_processes = False
