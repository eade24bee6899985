"""Proposers of draft tokens: a sequence's likely next tokens, to be verified in one forward pass.

`NgramProposer` (prompt lookup) needs no model: it finds the latest earlier
place where the sequence's last n tokens occurred (in its prompt, which holds
a session's transcript, or in its output so far) and proposes the tokens that
followed there. It costs microseconds and pays off where the answer quotes
its input (extraction, editing, code, summaries that repeat names); where it
finds nothing it proposes nothing and the sequence decodes as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Proposer(Protocol):
    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `token_ids` (none when there is no good guess)."""


class NgramProposer:
    """The tokens after the latest earlier occurrence of the sequence's last n tokens, for n from
    `max_n` down to `min_n` (the longest match wins: it predicts better)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        length = len(token_ids)
        if max_tokens <= 0 or length <= self.min_n:
            return []
        # Candidates, latest first: earlier positions holding the last token, found by C-level list searches (a
        # decode proposes every step, so a pass converting the whole sequence costs every step, ~35 us at 300
        # tokens on a slow core, against a few for the searches).
        last = token_ids[-1]
        earlier = token_ids[-2::-1]
        ends: list[int] = []
        found = earlier.index(last) if last in earlier else -1
        while found >= 0:
            ends.append(length - 2 - found)
            try:
                found = earlier.index(last, found + 1)
            except ValueError:
                break
        if not ends:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = token_ids[length - n : length - 1]
            for end in ends:  # the latest occurrence: nearest context, likeliest to go on alike
                if end >= n - 1 and token_ids[end - n + 1 : end] == tail:
                    return token_ids[end + 1 : end + 1 + max_tokens]
        return []


# name of the `speculative_decoding` setting's proposer -> how to build it from (min_n, max_n)
PROPOSERS: dict[str, Callable[[int, int], Proposer]] = {"ngram": NgramProposer}
