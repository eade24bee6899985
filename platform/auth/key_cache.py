"""Authenticated API keys remembered briefly, by key hash, and never served once known to be revoked.

Why: without it every request costs a database round trip before anything
else happens, and a database outage turns into a total outage although the
engine, Redis and the usage journal are all fine.

Revocation, and what each deployment guarantees:
- This process forgets a key the moment it revokes it, and remembers the key
  id as revoked.
- With Redis, every revocation (API or CLI) is added to a revocation set and
  published (platform/auth/revocation.py); every process drops the key from
  its cache when the message arrives (milliseconds), and re-reads the whole
  set whenever its subscription (re)connects. A revoked key is never served
  from this cache again, during a database outage included.
- Otherwise (no Redis, or the revocation feed disconnected) entries are fresh
  for `fresh_s`: a key revoked by another process stops working within that.
- While the database is unreachable, unknown keys get 503, never a guess. A
  known key is served from an entry up to `stale_s` old only if its revocation
  state is certain: with a healthy revocation feed, any entry; without one,
  only entries confirmed within `fresh_s` of this process's last successful
  key lookup (so a key revoked before the outage began, and not looked up
  since, is refused; the exposure left is a revocation committed in the last
  `fresh_s` before the database went down, the same window as normal operation).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class RevocationFeed(Protocol):
    """Tells the other processes about a revocation; `healthy` while it is sure to hear theirs."""

    @property
    def healthy(self) -> bool: ...

    def announce(self, key_id: str) -> None: ...


class KeyCache(Generic[T]):
    def __init__(self, *, fresh_s: float, stale_s: float, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fresh_s = fresh_s
        self._stale_s = max(stale_s, fresh_s)
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, str, T]] = OrderedDict()  # hash → (fetched, key id, value)
        self._revoked: set[str] = set()  # key ids known to be revoked
        self._last_confirmed = float("-inf")  # when the database last answered a key lookup
        self._lock = threading.Lock()  # auth runs in the threadpool
        self.feed: RevocationFeed | None = None

    def fresh(self, key_hash: str) -> T | None:
        return self._get(key_hash, self._fresh_s)

    def stale(self, key_hash: str) -> T | None:
        """For when the database is unreachable: an older entry beats refusing a known key, when its
        revocation state is certain (see the module docstring)."""
        with self._lock:
            entry = self._entries.get(key_hash)
        if entry is None:
            return None
        fetched, key_id, value = entry
        if key_id in self._revoked or self._clock() - fetched > self._stale_s:
            return None
        if (self.feed is None or not self.feed.healthy) and fetched < self._last_confirmed - self._fresh_s:
            return None
        return value

    def put(self, key_hash: str, key_id: str, value: T) -> None:
        self.note_confirmed()
        if self._fresh_s <= 0 or key_id in self._revoked:
            return
        with self._lock:
            self._entries[key_hash] = (self._clock(), key_id, value)
            self._entries.move_to_end(key_hash)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def note_confirmed(self) -> None:
        """The database answered a key lookup (valid or not) just now."""
        self._last_confirmed = self._clock()

    def forget_key(self, key_id: str) -> None:
        """The key was revoked here: drop it, remember it, and tell the other processes."""
        self.mark_revoked(key_id)
        if self.feed is not None:
            self.feed.announce(key_id)

    def mark_revoked(self, key_id: str) -> None:
        """The key was revoked (here or, as the revocation feed says, elsewhere): never serve it again."""
        with self._lock:
            self._revoked.add(key_id)
        self.drop_entries(key_id)

    def drop_entries(self, key_id: str) -> None:
        """The key changed but stays valid (its tenant's weight, say): its next request reads it afresh. Not a
        revocation: nothing is remembered or announced, so the key is cached again and survives an outage."""
        with self._lock:
            for key_hash in [h for h, (_, kid, _) in self._entries.items() if kid == key_id]:
                del self._entries[key_hash]

    def _get(self, key_hash: str, max_age_s: float) -> T | None:
        with self._lock:
            entry = self._entries.get(key_hash)
        if entry is None or entry[1] in self._revoked or self._clock() - entry[0] > max_age_s:
            return None
        return entry[2]
