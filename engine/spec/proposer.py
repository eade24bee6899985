"""Proposers of draft tokens: a sequence's likely next tokens, to be verified in one forward pass.

`NgramProposer` (prompt lookup) needs no model: it finds the latest earlier
place where the sequence's last n tokens occurred (in its prompt, which holds
a session's transcript, or in its output so far) and proposes the tokens that
followed there. It pays off where the answer quotes its input (extraction,
editing, code, summaries that repeat names); where it finds nothing it
proposes nothing and the sequence decodes as usual.

Its cost must not grow with what a tenant sends: a decode proposes every
step, and a search over the whole sequence cost 14 ms a step (on a slow core)
for a 32,000-token prompt of one token pair repeated, a step of every
tenant's rows. So each sequence keeps an `NgramIndex` of where its
`min_n`-grams end, grown by the tokens added since its last step, and a
proposal looks at no more than `MAX_CANDIDATES` of the latest places.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

# Earlier places ending in the sequence's last min_n tokens that one proposal compares, latest first. Past it,
# older places are not looked at: a crafted prompt repeating one n-gram thousands of times costs what 64 do.
MAX_CANDIDATES = 64
# A match shorter than this many tokens drafts only where it is the sequence's one earlier occurrence of those
# tokens. A short n-gram seen twice or more is a common pair (an indent and a keyword, a comma and "and"), and
# what followed its latest occurrence predicted poorly: in 128-token greedy answers of SmolLM2-135M at batch 8,
# repeated 2-token matches had 1 of 92 drafted tokens accepted on code editing and 0 of 32 on JSON, unique ones
# 24% and 17% there and 80% on extraction, 3- and 4-token matches 62-100% everywhere. On 24 prompts outside the
# benchmark (batch 1) the rule cut verifications by 6-17% and accepted tokens by under 3%.
UNIQUE_BELOW = 3


class Proposer(Protocol):
    def new_state(self) -> Any:
        """What this proposer keeps for one sequence between its steps (kept on the sequence, dropped with it)."""

    def propose(self, token_ids: list[int], max_tokens: int, state: Any = None, cautious: bool = False) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `token_ids` (none when there is no good guess). `state`:
        this sequence's `new_state()`, whose earlier work the proposer may reuse; None: from the tokens alone.
        `cautious`: only the proposer's surest kind of guess (the sequence's drafts were rejected lately)."""


class NgramIndex:
    """Where each `key_n`-gram of one sequence ends, for every position but the last (which a placeholder of
    overlapped scheduling may hold), grown as the sequence grows: tokens once there never change."""

    __slots__ = ("ends", "key_n", "num_indexed")

    def __init__(self, key_n: int) -> None:
        self.key_n = key_n
        self.ends: dict[Any, list[int]] = {}  # n-gram (a token where key_n is 1) -> end positions, ascending
        self.num_indexed = 0                  # positions below this are in `ends`

    def key(self, token_ids: list[int], end: int) -> Any:
        n = self.key_n
        return token_ids[end] if n == 1 else tuple(token_ids[end - n + 1 : end + 1])

    def update(self, token_ids: list[int]) -> None:
        """Index every position before the last."""
        upto = len(token_ids) - 1
        if upto < self.num_indexed:  # the tokens were cut back (nothing does that today): index them again
            self.ends.clear()
            self.num_indexed = 0
        n, start = self.key_n, max(self.num_indexed, self.key_n - 1)
        # the n-gram ending at each position from `start` to `upto`, made by C-level slicing and zipping
        keys = token_ids[start:upto] if n == 1 else zip(*(token_ids[start - i : upto - i] for i in range(n - 1, -1, -1)), strict=True)
        ends = self.ends
        for end, key in enumerate(keys, start):
            found = ends.get(key)
            if found is None:
                ends[key] = [end]
            else:
                found.append(end)
        self.num_indexed = max(self.num_indexed, upto)


class NgramProposer:
    """The tokens after the latest earlier occurrence of the sequence's last n tokens, for n from
    `max_n` down to `min_n` (the longest match wins: it predicts better)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n

    def new_state(self) -> NgramIndex:
        return NgramIndex(self.min_n)

    def propose(self, token_ids: list[int], max_tokens: int, state: NgramIndex | None = None,
                cautious: bool = False) -> list[int]:
        """`cautious`: matches of UNIQUE_BELOW tokens or more only."""
        length = len(token_ids)
        if max_tokens <= 0 or length <= self.min_n:
            return []
        index = state if state is not None else self.new_state()
        index.update(token_ids)
        ends = index.ends.get(index.key(token_ids, length - 1))
        if not ends:
            return []
        candidates = ends[: -MAX_CANDIDATES - 1 : -1]  # each already matches the last min_n tokens; latest first
        shortest = max(self.min_n, UNIQUE_BELOW) if cautious else self.min_n
        for n in range(min(self.max_n, length - 1), shortest - 1, -1):
            tail = token_ids[length - n : length - 1]
            # the latest occurrence: nearest context, likeliest to go on alike
            matches = (end for end in candidates if end >= n - 1 and token_ids[end - n + 1 : end] == tail)
            latest = next(matches, None)
            if latest is None:
                continue
            if n < UNIQUE_BELOW and next(matches, None) is not None:
                return []  # a common short phrase; a shorter n would be commoner still
            return token_ids[latest + 1 : latest + 1 + max_tokens]
        return []


# name of the `speculative_decoding` setting's proposer -> how to build it from (min_n, max_n)
PROPOSERS: dict[str, Callable[[int, int], Proposer]] = {"ngram": NgramProposer}
