"""The shortest way to finish: a token plan that completes the grammar from where the matcher stands.

Near the end of a request's token budget the matcher follows such a plan, so
a response cut by `max_tokens` still ends as a complete document. The plan is
found greedily on the real matcher (accept, then roll back), preferring at
each step the tokens that close what is open (`"`, `]`, `}`), then `,`
(when a minimum count forces another item), then the smallest values (`1`
before `0`, so digits inside dates and times make real ones, `""`, `[]`,
`{}`, `null`, ...; `Z` ends a time, `@` an email's local part), and otherwise the longest allowed token (forced keys and
enum values go fastest that way).

The greedy walk picks one token at a time, so it spells the text in more
tokens than needed (`""` then `,` where the tokenizer has `"",`): the text
it found is then tokenized as a whole, and that spelling is kept when it is
shorter and the matcher accepts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

_CLOSER_BYTES = frozenset(b'"]}')
_OPENER_BYTES = frozenset(b",[{")
# Also open something that needs more tokens to close: a time-zone offset (`+01:00`), a negative number or
# a date's next field (`-`), an escape (`\u00e9`). One of these sampled just before the close can lengthen
# it by several tokens at once.
_OPENS_ANYTHING_BYTES = _OPENER_BYTES | frozenset(b"+-\\")
_SMALL_VALUES = (b"1", b"0", b'""', b'"', b"[]", b"{}", b"null", b"false", b"true", b"[", b"{", b"a")
# Separators may put a space before a value (`": "`): each small value also with one.
_PREFERRED_AFTER_CLOSERS = (b",", b", ", *_SMALL_VALUES, *(b" " + value for value in _SMALL_VALUES))


class ClosingTokens:
    """Per tokenizer: the token ids the plan prefers, in order, and every token's length."""

    def __init__(self, token_bytes: list[bytes], special_ids: set[int], vocab_size: int,
                 encode: Callable[[str], list[int]] | None = None) -> None:
        self.num_words = (vocab_size + 31) // 32
        self.token_bytes = token_bytes
        self.encode = encode  # the tokenizer's own spelling of a text (no special tokens)
        lengths = np.zeros(self.num_words * 32, dtype=np.int32)
        by_text: dict[bytes, int] = {}
        closers: list[tuple[bool, int, int]] = []  # (not a quote first, -length, token id): sorts best first
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
        self.calm_bits = self._bits_without(_OPENER_BYTES, token_bytes, special_ids)
        # Tokens that open nothing at all: the only free choices in the last few tokens before the close.
        self.steady_bits = self._bits_without(_OPENS_ANYTHING_BYTES, token_bytes, special_ids)
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

    def _bits_without(self, forbidden: frozenset[int], token_bytes: list[bytes], special_ids: set[int]) -> torch.Tensor:
        """A bitmask row of the tokens that hold none of `forbidden`'s bytes (special tokens never)."""
        keep = np.zeros(self.num_words * 32, dtype=np.uint8)
        for token_id, text in enumerate(token_bytes):
            if token_id not in special_ids and text and not forbidden.intersection(text):
                keep[token_id] = 1
        return torch.from_numpy(np.packbits(keep, bitorder="little").view(np.int32).copy())

    def pick(self, row: np.ndarray) -> int | None:
        """The preferred allowed token of a bitmask row (int32 words); None if nothing is allowed."""
        for token_id in self.preferred:
            if (int(row[token_id >> 5]) >> (token_id & 31)) & 1:
                return token_id
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")
        scores = np.where(allowed[: self.lengths.size].astype(bool), self.lengths, 0)
        best = int(scores.argmax())
        return best if scores[best] > 0 else None

    def respell(self, plan: list[int]) -> list[int] | None:
        """The tokenizer's spelling of the plan's text, when it is shorter; None otherwise."""
        if self.encode is None or len(plan) < 2:
            return None
        # The plan may first finish a character a sampled token left half-written: those tokens stay, the text
        # from the first token that starts on a character boundary is spelled anew.
        for start in range(min(len(plan) - 1, 4)):
            try:
                text = b"".join(self.token_bytes[token_id] for token_id in plan[start:]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            spelled = plan[:start] + self.encode(text)
            return spelled if len(spelled) < len(plan) else None
        return None


def plan_completion(matcher: Any, tokens: ClosingTokens, limit: int) -> list[int] | None:
    """Tokens that complete `matcher`'s grammar (at most `limit`); the matcher is left where it was."""
    plan = _greedy_plan(matcher, tokens, limit)
    if plan is None:
        return None
    shorter = tokens.respell(plan)
    return shorter if shorter is not None and _completes(matcher, shorter) else plan


def continuation_cost(matcher: Any, tokens: ClosingTokens, limit: int, *, opening: bool = False) -> int | None:
    """The tokens that going on by one token and then closing would take: by the plan's first pick, or with
    `opening` by a token that opens a new item (`,`, `[`, `{`). None when no such token may follow (a stop
    token never counts). The matcher is left where it was."""
    row = torch.empty((1, tokens.num_words), dtype=torch.int32)
    matcher.fill_bitmask(row, 0)
    if opening:
        row[0] &= ~tokens.calm_bits
    token_id = tokens.pick(row[0].numpy())  # never a special (stop) token
    if token_id is None or not matcher.accept_token(token_id):
        return None
    try:
        plan = plan_completion(matcher, tokens, limit)
        return limit + 1 if plan is None else 1 + len(plan)  # no plan within the limit: going on cannot close
    finally:
        matcher.rollback(1)


def _greedy_plan(matcher: Any, tokens: ClosingTokens, limit: int) -> list[int] | None:
    row = torch.empty((1, tokens.num_words), dtype=torch.int32)
    plan: list[int] = []
    try:
        while not matcher.is_completed():
            if len(plan) >= limit:
                return None
            # Text the grammar forces is taken as it is spelled, without a mask per token: a mask can cost a
            # millisecond in a long literal, and the walk through a schema's long `const` would pay it per token.
            taken = 0
            for token_id in matcher.forced_token_ids()[: limit - len(plan)]:
                if not matcher.accept_token(token_id):
                    break
                plan.append(token_id)
                taken += 1
            if taken:
                continue
            matcher.fill_bitmask(row, 0)
            token_id = tokens.pick(row[0].numpy())
            if token_id is None or not matcher.accept_token(token_id):
                return None
            plan.append(token_id)
        return plan
    finally:
        matcher.rollback(len(plan))


def _completes(matcher: Any, plan: list[int]) -> bool:
    """The matcher accepts every token of `plan` and is complete after it; it is left where it was."""
    accepted = 0
    try:
        for token_id in plan:
            if not matcher.accept_token(token_id):
                return False
            accepted += 1
        return bool(matcher.is_completed())
    finally:
        matcher.rollback(accepted)


def unfinishable(matcher: Any, tokens: ClosingTokens, limit: int) -> str | None:
    """Why no output can complete `matcher`'s grammar from its start, or None when one may. Sound, not complete:
    it follows only what the grammar forces, so it proves the two ways a well-formed grammar has no finite output
    (nothing but a stop token may come before the output is complete; or every token is forced, on without end)
    and answers None at the first free choice (whether that choice leads anywhere would take a search that can
    cost without bound)."""
    row = torch.empty((1, tokens.num_words), dtype=torch.int32)
    walked = 0
    while not matcher.is_completed():
        forced = matcher.forced_token_ids()
        if not forced:
            matcher.fill_bitmask(row, 0)
            return None if tokens.pick(row[0].numpy()) is not None else "it allows no output"
        walked += len(forced)
        if walked > limit:
            return f"every output it allows goes on without end (more than {limit} tokens forced)"
        for token_id in forced:
            if not matcher.accept_token(token_id):
                return None  # the backend's forced tokens were not its own: no proof either way
    return None
