"""The values a unique array of a finite string set may still take, answered in O(log n) per question.

The matcher asks, for every token the grammar allows inside such an item, whether some value not yet used
begins with the text so far plus the token. Scanning all members for each token cost ~50 µs a token and
~100 ms a row a step for an enum of a thousand values: here the unused values' texts are kept sorted (per
set of used values, rebuilt once an item is added), and a prefix question is one bisection.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

_MAX_INDEXES = 256


class MemberIndex:
    """The (UTF-8 text as written in JSON, value) pairs of one array's members, sorted by text."""

    __slots__ = ("_last", "texts", "values")

    def __init__(self, members: frozenset) -> None:
        pairs = sorted(members, key=lambda pair: pair[0])
        self.texts = [text for text, _ in pairs]
        self.values = [value for _, value in pairs]
        self._last: tuple[Any, list[bytes]] = (None, [])

    def has_unused(self, prefix: bytes, seen: Any) -> bool:
        """Some value not in `seen` is written with a text that begins with `prefix`."""
        unused = self._unused(seen)
        at = bisect_left(unused, prefix)
        return at < len(unused) and unused[at].startswith(prefix)

    def _unused(self, seen: Any) -> list[bytes]:
        # The questions of one mask fill share one `seen` object: keyed by identity, rebuilt when it changes (one
        # tuple, read and written whole, so two threads cannot pair one set with another's list).
        last_seen, unused = self._last
        if seen is not last_seen:
            unused = [text for text, value in zip(self.texts, self.values, strict=True) if value not in seen]
            self._last = (seen, unused)
        return unused


_INDEXES: dict[int, tuple[frozenset, MemberIndex]] = {}


def member_index(members: frozenset | None) -> MemberIndex | None:
    """The index of a plan's member set, built once per set (the plan keeps its sets; the entry keeps the set
    alive too, so its id is not reused while it is here)."""
    if members is None:
        return None
    entry = _INDEXES.get(id(members))
    if entry is not None and entry[0] is members:
        return entry[1]
    if len(_INDEXES) >= _MAX_INDEXES:
        _INDEXES.clear()
    index = MemberIndex(members)
    _INDEXES[id(members)] = (members, index)
    return index
