"""The shortest way to finish: a token plan that completes the grammar from where the matcher stands.

Near the end of a request's token budget the matcher follows such a plan, so
a response cut by `max_tokens` still ends as a complete document. The plan is
found greedily on the real matcher (accept, then roll back), preferring at
each step the tokens that close what is open (`"`, `]`, `}`), then `,`
(when a minimum count forces another item), then the smallest values (`1`
before `0`, so digits inside dates and times make real ones, `""`, `[]`,
`{}`, `null`, ...; `Z` ends a time, `@` an email's local part), and otherwise the longest allowed token (forced keys and
enum values go fastest that way).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_CLOSER_BYTES = frozenset(b'"]}')
_OPENER_BYTES = frozenset(b",[{")
_SMALL_VALUES = (b"1", b"0", b'""', b'"', b"[]", b"{}", b"null", b"false", b"true", b"[", b"{", b"a")
# Separators may put a space before a value (`": "`): each small value also with one.
_PREFERRED_AFTER_CLOSERS = (b",", b", ", *_SMALL_VALUES, *(b" " + value for value in _SMALL_VALUES))


class ClosingTokens:
    """Per tokenizer: the token ids the plan prefers, in order, and every token's length."""

    def __init__(self, token_bytes: list[bytes], special_ids: set[int], vocab_size: int) -> None:
        self.num_words = (vocab_size + 31) // 32
        lengths = np.zeros(self.num_words * 32, dtype=np.int32)
        by_text: dict[bytes, int] = {}
        closers: list[tuple[int, int]] = []
        for token_id, text in enumerate(token_bytes):
            if token_id in special_ids or not text:
                continue
            lengths[token_id] = len(text)
            by_text.setdefault(text, token_id)
            if set(text) <= _CLOSER_BYTES:
                # A quote first: inside a string only a leading quote closes anything.
                closers.append((text[0] != ord('"'), -len(text), token_id))
        self.lengths = lengths
        # Tokens that cannot open a new item, array or object: the only free choices left near the
        # end of the budget, so one sampled token cannot push the close past it.
        calm = np.zeros(self.num_words * 32, dtype=np.uint8)
        for token_id, text in enumerate(token_bytes):
            if token_id not in special_ids and text and not _OPENER_BYTES.intersection(text):
                calm[token_id] = 1
        self.calm_bits = torch.from_numpy(np.packbits(calm, bitorder="little").view(np.int32).copy())
        preferred = [token_id for *_, token_id in sorted(closers)]
        # Ends a date-time's time: without it, the fraction of a second (`.2587...`) admits a digit
        # forever and the smallest-value rule below would never reach the closing quote.
        for text in (b"Z", b'Z"'):
            if text in by_text:
                preferred.insert(0 if text == b'Z"' else len(preferred), by_text[text])
        # Ends an email's local part, where `}`, `]`, letters and digits are allowed forever; outside a string it
        # is never allowed, so it may come right after the tokens that close a string.
        if b"@" in by_text:
            preferred.insert(sum(1 for quoted, *_ in closers if not quoted), by_text[b"@"])
        for text in _PREFERRED_AFTER_CLOSERS:
            if text in by_text:
                preferred.append(by_text[text])
        self.preferred = preferred

    def pick(self, row: np.ndarray) -> int | None:
        """The preferred allowed token of a bitmask row (int32 words); None if nothing is allowed."""
        for token_id in self.preferred:
            if (int(row[token_id >> 5]) >> (token_id & 31)) & 1:
                return token_id
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")
        scores = np.where(allowed[: self.lengths.size].astype(bool), self.lengths, 0)
        best = int(scores.argmax())
        return best if scores[best] > 0 else None


def plan_completion(matcher: Any, tokens: ClosingTokens, limit: int) -> list[int] | None:
    """Tokens that complete `matcher`'s grammar (at most `limit`); the matcher is left where it was."""
    row = torch.empty((1, tokens.num_words), dtype=torch.int32)
    plan: list[int] = []
    try:
        while not matcher.is_completed():
            if len(plan) >= limit:
                return None
            matcher.fill_bitmask(row, 0)
            token_id = tokens.pick(row[0].numpy())
            if token_id is None or not matcher.accept_token(token_id):
                return None
            plan.append(token_id)
        return plan
    finally:
        matcher.rollback(len(plan))
