"""Stop-string matcher: the same output as the plain search it replaced, at a cost per token
independent of the number of stop strings and of the output's length."""

from __future__ import annotations

import random
import time

import pytest
from loraplex.engine.output.stop_strings import StopStringMatcher


class NaiveStopMatcher:
    """The reference: search every stop string in the text so far, hold back any suffix
    that is a proper prefix of a stop string."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.num_emitted = 0
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
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
        return self._emit(len(self.text))

    def _held_back(self) -> int:
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


def run(matcher, pieces: list[str]) -> tuple[list[str], str | None]:
    """Feed pieces until a stop matches (as the engine does), then flush."""
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.matched is not None:
            break
    out.append(matcher.flush())
    return out, matcher.matched


def random_chunks(rng: random.Random, text: str) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice([0, 1, 1, 1, 2, 3, 5, 8, 20])
        pieces.append(text[i : i + n])
        i += n
    return pieces


@pytest.mark.parametrize("alphabet", ["ab", "abc", "abcd ", "aé😀\n"])
def test_equals_naive_matcher_on_random_stop_sets_and_chunkings(alphabet):
    rng = random.Random(hash(alphabet) & 0xFFFF)
    num_stopped = 0
    for _ in range(1500):
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
                for _ in range(rng.randint(0, 8))]
        if rng.random() < 0.2 and stop:
            stop.append(rng.choice(stop))  # duplicates keep the first index
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        pieces = random_chunks(rng, text)
        expected = run(NaiveStopMatcher(stop), pieces)
        assert run(StopStringMatcher(stop), pieces) == expected, (stop, pieces)
        num_stopped += expected[1] is not None
    assert num_stopped > 300  # the sets do stop often enough to exercise matches


def test_earliest_start_wins_inside_one_piece_and_ties_go_to_the_first_listed():
    assert run(StopStringMatcher(["c", "abcd"]), ["xabcdy"]) == (["x", ""], "abcd")
    assert run(StopStringMatcher(["c", "abcd"]), ["xabc", "dy"]) == (["xab", ""], "c")
    assert run(StopStringMatcher(["ab", "abc"]), ["zabc"]) == (["z", ""], "ab")
    assert run(StopStringMatcher(["abc", "ab"]), ["zabc"]) == (["z", ""], "abc")


def test_held_back_text_is_released_when_it_cannot_start_a_stop_string():
    matcher = StopStringMatcher(["abcX", "bcd"])
    assert matcher.feed("zab") == "z"
    assert matcher.feed("c") == ""     # "abc" could still be "abcX", "bc" could be "bcd"
    assert matcher.feed("Y") == "abcY"
    assert matcher.matched is None
    assert matcher.feed("bc") == ""
    assert matcher.flush() == "bc"


def test_identical_stop_lists_share_one_automaton():
    stop = [f"stop-{i}" for i in range(50)]
    assert StopStringMatcher(stop).automaton is StopStringMatcher(list(stop)).automaton


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> float:
    start = time.process_time()
    for piece in pieces:
        matcher.feed(piece)
    return time.process_time() - start


def test_thousands_of_stop_strings_cost_per_token_like_one():
    """4,000 stop strings over a 20,000-token generation: the time per token stays within a
    small factor of a single stop string's, and flat as the output grows."""
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", " the", " of", " and", ",", ".", "\n", "ing", "tion"]
    pieces = [rng.choice(words) for _ in range(20_000)]
    text = "".join(pieces)
    # Stop strings sharing long prefixes with the text (the held-back path is taken constantly),
    # none of which occurs in it.
    many = [text[i : i + rng.randint(4, 40)] + "\x00" for i in rng.sample(range(len(text) - 50), 4000)]
    start = time.process_time()
    many_matcher = StopStringMatcher(many)
    build_s = time.process_time() - start
    one = feed_all(StopStringMatcher(["\x00"]), pieces)
    first_half = feed_all(many_matcher, pieces[:10_000])
    second_half = feed_all(many_matcher, pieces[10_000:])
    assert many_matcher.matched is None
    assert first_half + second_half < max(20 * one, 0.5), (one, first_half, second_half)
    assert second_half < 3 * first_half + 0.05  # no growth with the text's length
    assert build_s < 2.0
    naive = NaiveStopMatcher(many)
    naive_s = feed_all(naive, pieces[:200])  # the old search, for the record: per token ~O(stop strings)
    assert naive_s / 200 > (first_half + second_half) / 20_000


def test_include_in_output_returns_exactly_the_text_up_to_the_end_of_the_stop_string():
    rng = random.Random(11)
    for _ in range(1500):
        stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        pieces = random_chunks(rng, text)
        emitted, matched = run(NaiveStopMatcher(stop), pieces)
        expected = "".join(emitted) + (matched or "")
        out, got = run(StopStringMatcher(stop, include_in_output=True), pieces)
        assert ("".join(out), got) == (expected, matched), (stop, pieces)
