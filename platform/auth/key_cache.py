"""Authenticated API keys remembered briefly, by key hash.

Why: without it every request costs a database round trip before anything
else happens, and a database outage turns into a total outage although the
engine, Redis and the usage journal are all fine. Entries are fresh for
`fresh_s` (a key revoked in another process stops working within that time;
this process forgets a key the moment it revokes it). When the database is
unreachable, entries up to `stale_s` old keep serving the keys they know;
unknown keys then get 503, never a guess.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class KeyCache(Generic[T]):
    def __init__(self, *, fresh_s: float, stale_s: float, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fresh_s = fresh_s
        self._stale_s = max(stale_s, fresh_s)
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, str, T]] = OrderedDict()  # hash → (fetched, key id, value)
        self._lock = threading.Lock()  # auth runs in the threadpool

    def fresh(self, key_hash: str) -> T | None:
        return self._get(key_hash, self._fresh_s)

    def stale(self, key_hash: str) -> T | None:
        """For when the database is unreachable: an older entry beats refusing a known key."""
        return self._get(key_hash, self._stale_s)

    def put(self, key_hash: str, key_id: str, value: T) -> None:
        if self._fresh_s <= 0:
            return
        with self._lock:
            self._entries[key_hash] = (self._clock(), key_id, value)
            self._entries.move_to_end(key_hash)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def forget_key(self, key_id: str) -> None:
        with self._lock:
            for key_hash in [h for h, (_, kid, _) in self._entries.items() if kid == key_id]:
                del self._entries[key_hash]

    def _get(self, key_hash: str, max_age_s: float) -> T | None:
        with self._lock:
            entry = self._entries.get(key_hash)
        if entry is None or self._clock() - entry[0] > max_age_s:
            return None
        return entry[2]
