"""Stop strings matched on text across token boundaries.

Text that could still be the start of a stop string is held back until
the next tokens decide; the stop string itself is never returned. When
several stop strings complete in the same piece of text, the one that
starts earliest wins (ties: the first in the request's list).

Matching is an Aho-Corasick automaton fed only the new text: its state
carries across tokens, so the cost of a token is the length of its text
(amortized), whatever the number of stop strings or the length of the
output so far. Automata are built once per distinct stop list and shared
by every choice and request that sends the same list.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

_ROOT = 0
_NO_WORD = -1


class StopAutomaton:
    """Immutable Aho-Corasick automaton over a list of stop strings.

    Per state: `depth` (the length of the text it stands for, the longest
    suffix of the output that is a prefix of some stop string) and
    `longest_word` (the stop string, by list index, that is the longest
    suffix of that text, or -1).
    """

    __slots__ = ("depth", "fail", "goto", "longest_word", "max_len", "stop")

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.max_len = max((len(s) for s in stop), default=0)
        self.goto: list[dict[str, int]] = [{}]
        self.depth: list[int] = [0]
        own_word: list[int] = [_NO_WORD]
        for index, word in enumerate(stop):
            state = _ROOT
            for ch in word:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    own_word.append(_NO_WORD)
                state = nxt
            if own_word[state] == _NO_WORD:  # a repeated string keeps its first index
                own_word[state] = index
        self.fail = [_ROOT] * len(self.goto)
        self.longest_word = own_word[:]
        queue: deque[int] = deque(self.goto[_ROOT].values())
        while queue:
            state = queue.popleft()
            for ch, child in self.goto[state].items():
                queue.append(child)
                self.fail[child] = self.step(self.fail[state], ch) if state != _ROOT else _ROOT
                if own_word[child] == _NO_WORD:
                    self.longest_word[child] = self.longest_word[self.fail[child]]

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state != _ROOT and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, _ROOT)


@lru_cache(maxsize=64)
def stop_automaton(stop: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stop)


class StopStringMatcher:
    def __init__(self, stop: list[str], *, include_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_in_output = include_in_output  # the matched stop string is returned, not cut
        self.automaton = stop_automaton(tuple(self.stop)) if self.stop else None
        self.state = _ROOT
        self.num_chars = 0      # characters fed so far
        self.num_emitted = 0    # characters already returned
        self.held = ""          # fed but not returned: a possible start of a stop string
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add decoded text; return what may be emitted now. Sets `matched` on a stop."""
        automaton = self.automaton
        if automaton is None:
            return delta
        goto, fail, depth, longest_word = automaton.goto, automaton.fail, automaton.depth, automaton.longest_word
        stop, max_len = automaton.stop, automaton.max_len
        state = self.state
        best_start, best_word = -1, _NO_WORD
        end = self.num_chars
        for ch in delta:
            end += 1
            if best_word != _NO_WORD and end - max_len > best_start:
                break  # no stop string ending here can start at or before the best one
            while state != _ROOT and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, _ROOT)
            word = longest_word[state]
            if word != _NO_WORD:
                start = end - len(stop[word])
                if best_word == _NO_WORD or start < best_start or (start == best_start and word < best_word):
                    best_start, best_word = start, word
        text = self.held + delta
        if best_word != _NO_WORD:
            self.matched = stop[best_word]
            self.held = ""
            kept = len(self.matched) if self.include_in_output else 0
            return self._emit(text, best_start - self.num_emitted + kept)
        self.state = state
        self.num_chars += len(delta)
        return self._emit(text, len(text) - depth[state])

    def flush(self) -> str:
        """At the end of generation, release held-back text (no stop string completed)."""
        return self._emit(self.held, len(self.held))

    def _emit(self, text: str, count: int) -> str:
        count = max(count, 0)
        self.held = text[count:] if self.matched is None else ""
        self.num_emitted += count
        return text[:count]
