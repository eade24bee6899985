"""Stop strings matched on text across token boundaries.

Text that could still be the start of a stop string is held back until
the next tokens decide; the stop string itself is never returned.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.text = ""          # everything decoded so far
        self.num_emitted = 0    # characters of `text` already returned
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add decoded text; return what may be emitted now. Sets `matched` on a stop."""
        if not self.stop:
            return delta
        search_from = max(0, len(self.text) - self.max_len + 1)
        self.text += delta
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.matched = best[1]
            self.text = self.text[: best[0]]
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back())

    def flush(self) -> str:
        """At the end of generation, release held-back text (no stop string completed)."""
        return self._emit(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(self.max_len - 1, len(self.text)), 0, -1):
            suffix = self.text[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0

    def _emit(self, end: int) -> str:
        end = max(end, self.num_emitted)
        out = self.text[self.num_emitted : end]
        self.num_emitted = end
        return out
