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

import numpy as np


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
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Candidates: earlier positions holding the last token; each n-gram size checks only them.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if ends.size == 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            found = ends[ends >= n - 1]
            if found.size == 0:
                continue
            if n > 1:
                tail = tokens[length - n : length - 1]
                offsets = np.arange(-(n - 1), 0)
                found = found[(tokens[found[:, None] + offsets] == tail).all(axis=1)]
            if found.size:
                start = int(found[-1]) + 1  # the latest occurrence: nearest context, likeliest to go on alike
                return token_ids[start : start + max_tokens]
        return []


# name of the `speculative_decoding` setting's proposer -> how to build it from (min_n, max_n)
PROPOSERS: dict[str, Callable[[int, int], Proposer]] = {"ngram": NgramProposer}
