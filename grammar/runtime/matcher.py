"""The engine-facing grammar objects (`engine.interfaces.CompiledGrammar` / `GrammarMatcher`), over any backend.

Two kinds of forced text run through one queue of token ids:
- text the grammar forces (keys, punctuation, the rest of an enum value),
  spelled as the backend tokenizes it;
- near the end of the token budget, the plan that closes the document
  (`closing.plan_completion`), so a `length` finish still parses.
While the queue is not empty the mask allows only its head; the engine may
instead append the whole queue at once (jump-forward) and prefill it in one
step. The queue is decided only when a token is accepted, so both paths see
the same states and emit the same tokens.

A choice ends the moment its grammar is complete and nothing but a stop
token could follow: the sampler never spends a step on the EOS token.

Planning walks the matcher token by token, so a long close (a regex of two
thousand digits, an array with a large `minItems`) costs as much as the text
it plans. A check that walked far defers the next one until the tokens
sampled since have paid for it (`_window`), and the thresholds it sets
widen by what the model could add over that window, so one choice never
costs the engine more than a few dozen planned tokens per output token,
whatever its grammar. Choices of one request start their windows staggered
(`phase`), so their long walks fall in different engine steps.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from math import ceil
from typing import Any

import torch
from loraplex.grammar.backends.protocol import BackendGrammar, BackendMatcher
from loraplex.grammar.runtime.closing import ClosingTokens, continuation_cost, plan_completion
from loraplex.grammar.spec import GrammarSpec

_CLOSING_MARGIN = 2      # tokens of slack: one calm token may add a token or two to the close
_GUARD_MARGIN = 16       # this close to the plan's length, tokens that open new items are masked
_CHECK_EVERY = 8         # far from the end, re-measure the closing plan this often
_TIGHT_MARGIN = 4        # this close to the plan's length, tokens that open anything at all are masked
_SHORT_WALK = 64         # a check that planned no more tokens than this may run again at the next token
_WALK_PER_TOKEN = 16     # beyond it, each output token pays for this many planned ones before the next check,
_MOST_WALK_PER_TOKEN = 64  # or, where the budget leaves too little room for that, as many as this, else it closes
_MAX_FIRST_WALKS = 16    # first walks remembered per grammar (a few token budgets)
_MAX_FIRST_WALK_TOKENS = 16_384  # and the tokens they may hold together
_MAX_FORCED = 1024       # forced tokens queued at a time
_UNWALKED = object()


def _window(walked: int, room: int, growth: int) -> int:
    """Output tokens to the next check, after one that planned `walked` tokens and left `room` tokens of slack
    for the close to lengthen by (each token by at most `growth`, and at least by the token it spends): as many
    as the walk asks, shortened to fit the room but never below what keeps planning cheap; 0 when none fits and
    the close must start now."""
    if room < 0:
        return 0
    fits = room // max(growth, 1) + 1
    shortest = -(-walked // _MOST_WALK_PER_TOKEN)
    if fits < shortest:
        return 0
    wanted = 1 if walked <= _SHORT_WALK else (walked - _SHORT_WALK) // _WALK_PER_TOKEN + 1
    return min(max(wanted, shortest), fits)


class StructuredGrammar:
    """A compiled grammar plus what every matcher of it needs; shared by all requests with its spec."""

    __slots__ = ("backend", "closing_tokens", "compile_ms", "first_walks", "inner", "relaxed", "spec",
                 "stop_token_ids")

    def __init__(self, spec: GrammarSpec, inner: BackendGrammar, compile_ms: float,
                 closing_tokens: ClosingTokens, stop_token_ids: list[int], relaxed: str | None = None) -> None:
        self.spec = spec
        self.relaxed = relaxed  # what a non-strict schema lost, when no backend enforces all of it
        self.inner = inner
        self.backend = inner.backend
        self.compile_ms = compile_ms
        self.closing_tokens = closing_tokens
        self.stop_token_ids = stop_token_ids
        # What walking from the start found (the forced text, the close per limit): every matcher of this grammar
        # starts in the same state, so the n choices of a request (and later requests) walk from there once.
        self.first_walks: dict[tuple[str, int], array[int] | int | None] = {}

    @property
    def memory_size_bytes(self) -> int:
        return self.inner.memory_size_bytes

    def new_matcher(self) -> StructuredMatcher:
        return StructuredMatcher(self.inner.new_matcher(), self.closing_tokens, self.stop_token_ids,
                                 self.first_walks)


class StructuredMatcher:
    """One choice's position in its grammar, with the forced-token queue and the token budget."""

    __slots__ = (
        "_budget",
        "_closing",
        "_continue_len",
        "_first_walks",
        "_fresh",
        "_guard_bits",
        "_guard_next",
        "_inner",
        "_last_check",
        "_max_growth",
        "_next_check",
        "_num_spent",
        "_open_len",
        "_plan_len",
        "_queue",
        "_stop_token_ids",
        "_tokens",
        "_window",
    )

    def __init__(self, inner: BackendMatcher, tokens: ClosingTokens, stop_token_ids: list[int],
                 first_walks: dict[tuple[str, int], array[int] | int | None] | None = None) -> None:
        self._inner = inner
        self._first_walks = first_walks
        self._fresh = True           # no token accepted yet: planning may reuse the grammar's first walks
        self._tokens = tokens
        self._stop_token_ids = stop_token_ids
        self._queue: list[int] = []
        self._budget: int | None = None
        self._num_spent = 0          # output tokens so far, this grammar's and any before it (reasoning)
        self._closing = False        # following the plan that closes the document
        self._plan_len = 0
        self._open_len = 0           # what opening a new item and closing it took, where last measured
        self._continue_len: int | None = None  # what going on from a complete match took, once measured
        self._max_growth = 0         # the most one token has lengthened the close so far
        self._guard_next: int | None = None  # near the end: the plan's next token, as of the last check
        self._guard_bits: torch.Tensor | None = None  # near the end: the tokens allowed beside the plan's next
        self._last_check = -_CHECK_EVERY
        self._next_check = 0         # no check before this many output tokens: the last one's walk is paid off
        self._window = 1             # the tokens the last check's thresholds allowed for
        self._refresh()

    # ---- engine protocol ------------------------------------------------------------------
    def accept_token(self, token_id: int) -> bool:
        if self._inner.is_terminated() or not self._inner.accept_token(token_id):
            return False
        self._num_spent += 1
        self._fresh = False
        if self._queue and self._queue[0] == token_id:
            self._queue.pop(0)
        else:  # a token the grammar allows but the queue did not name: re-plan from here
            self._queue.clear()
            self._closing = False
        if not self._queue:
            self._refresh()
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._queue:
            bitmask[row].zero_()
            _set_bit(bitmask, row, self._queue[0])
        elif self._inner.is_terminated() or (self._closing and self._inner.is_completed()):
            bitmask[row].zero_()
            for token_id in self._stop_token_ids:
                _set_bit(bitmask, row, token_id)
        else:
            self._inner.fill_bitmask(bitmask, row)
            if self._guard_bits is not None:
                self._guard(bitmask, row, self._guard_bits)

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (a `length` finish here still ends valid output)."""
        return self._inner.is_completed()

    def forced_token_ids(self) -> list[int]:
        """The tokens that will be forced next, in order: the engine may append them without sampling."""
        return list(self._queue)

    def set_token_budget(self, max_tokens: int, phase: int = 0) -> None:
        """The most output tokens this choice may produce; near it, the matcher closes the document. `phase` (the
        choice's index) staggers the choices' checks when planning is long."""
        self._budget = max_tokens
        if not self._queue or not self._closing:
            self._queue.clear()
            self._refresh()
            self._next_check -= phase % self._window  # checking early is always safe

    def spend_tokens(self, num_tokens: int) -> None:
        """Output tokens spent outside this grammar (a reasoning block before the answer)."""
        self._num_spent += num_tokens

    def closed_by_budget(self) -> bool:
        """True when the budget forced the close: the finish is `length`, though the output is complete."""
        return self._closing

    # ---- the queue ------------------------------------------------------------------------
    def _guard(self, bitmask: torch.Tensor, row: int, allowed: torch.Tensor) -> None:
        """Near the end: mask what could push the close past the budget; the plan's next token stays allowed (as of
        the last check, or the greedy planner's pick from here), and so do stop tokens where the grammar ends."""
        head = self._guard_next if self._guard_next is not None else self._tokens.pick(bitmask[row].numpy())
        stops = [token_id for token_id in self._stop_token_ids if _has_bit(bitmask, row, token_id)]
        bitmask[row] &= allowed
        for token_id in ([] if head is None else [head]) + stops:
            _set_bit(bitmask, row, token_id)

    def _refresh(self) -> None:
        self._guard_next = None
        if self._inner.is_terminated():
            return
        plan = self._closing_plan()
        if plan is not None:
            self._closing = True
            self._queue = plan
            return
        if not self._closing:
            self._queue = self._forced_token_ids()

    def _closing_plan(self) -> list[int] | None:
        """The closing plan when the budget left is about what closing takes; None while there is room."""
        if self._budget is None or self._closing:
            return None
        remaining = self._budget - self._num_spent
        if remaining <= 0 or self._num_spent < self._next_check:
            return None
        going_on = max(self._plan_len, self._open_len, self._continue_len or 0)
        near = remaining <= 2 * going_on + _GUARD_MARGIN + self._max_growth + 8
        # A complete match is checked until what going on from it costs is known: another tool call may cost as
        # much as the first; free text after an optional call, one token.
        unmeasured = self._continue_len is None and self._inner.is_completed()
        if not near and self._num_spent - self._last_check < _CHECK_EVERY and not unmeasured:
            return None
        since = self._num_spent - self._last_check
        measured = since == 1 or self._window > 1  # growth over one token, or on average over a deferred window
        self._last_check = self._num_spent
        self._guard_bits = None
        plan = self._plan(remaining + 64)
        if plan is None:  # no close within the budget: no thresholds to set, but the walk was long
            self._next_check = self._num_spent + _window(remaining + 64, remaining, 1)
            self._window = 1  # and no plan to measure growth from
            return None
        if not plan:
            return self._stop_if_going_on_cannot_close(remaining)
        if measured:
            self._max_growth = max(self._max_growth, ceil((len(plan) - self._plan_len + since) / since))
        self._plan_len = len(plan)
        window = self._window_to_close(len(plan), len(plan), remaining)
        if window:
            window = self._guard_if_opening_would_not_fit(plan, remaining, window)
        if not window:
            return plan
        self._window = window
        self._next_check = self._num_spent + window
        return None

    def _window_to_close(self, walked: int, close_len: int, remaining: int) -> int:
        """The window to the next check when the close takes `close_len` tokens; 0 when it must start now."""
        return _window(walked, remaining - close_len - _CLOSING_MARGIN - self._max_growth - 1, self._max_growth)

    def _window_growth(self, window: int) -> int:
        """What the close may lengthen by before the next check, `window` tokens on, with openers masked: one token
        by the most seen, each further one by that or at least the token it spends."""
        return self._max_growth + (window - 1) * max(self._max_growth, 1)

    def _forced_token_ids(self) -> list[int]:
        """The next forced tokens, at most `_MAX_FORCED` (the rest follow once these are taken): a long constant
        is appended and walked in parts, never whole in one engine step."""
        if not self._fresh or self._first_walks is None:
            return self._inner.forced_token_ids()[:_MAX_FORCED]
        return list(self._first_walk(("forced", 0), lambda: self._inner.forced_token_ids()[:_MAX_FORCED]))

    def _plan(self, limit: int) -> list[int] | None:
        if not self._fresh or self._first_walks is None:
            return plan_completion(self._inner, self._tokens, limit)
        found = self._first_walk(("plan", limit), lambda: plan_completion(self._inner, self._tokens, limit))
        return None if found is None else list(found)

    def _continuation_cost(self, limit: int, *, opening: bool = False) -> int | None:
        def walk() -> int | None:
            return continuation_cost(self._inner, self._tokens, limit, opening=opening)

        if not self._fresh or self._first_walks is None:
            return walk()
        return self._first_walk(("opening" if opening else "going on", limit), walk)

    def _first_walk(self, key: tuple[str, int], walk: Callable[[], Any]) -> Any:
        """A walk from the grammar's start, shared by every matcher of the grammar that has accepted nothing."""
        walks = self._first_walks
        assert walks is not None
        found = walks.get(key, _UNWALKED)  # one lookup: another engine thread may clear the dict meanwhile
        if found is _UNWALKED:
            found = walk()
            # Token lists kept packed (4 bytes a token) and few: a thousand cached grammars each holding long
            # plans for many budgets would otherwise hold gigabytes.
            kept = array("i", found) if isinstance(found, list) else found
            stored = sum(len(value) for value in walks.values() if isinstance(value, array))
            if len(walks) >= _MAX_FIRST_WALKS or stored + (len(found) if isinstance(found, list) else 0) > \
                    _MAX_FIRST_WALK_TOKENS:
                walks.clear()
            walks[key] = kept
        return found

    def _guard_if_opening_would_not_fit(self, plan: list[int], remaining: int, window: int) -> int:
        """Near the end, where a new item (array element, property) opened before the next check might not close in
        the budget left, mask the tokens that open one. Within the guard margin that is assumed; beyond it, the
        cost of opening one is measured where the grammar allows it (an item can cost more than the margin: a whole
        object of required properties). Returns the window to the next check, which the measuring walk may
        lengthen, or 0 when the close must start now."""
        guarded = remaining <= len(plan) + _GUARD_MARGIN + self._window_growth(window)
        if not guarded:
            cost = self._continuation_cost(remaining + 64, opening=True)
            if cost is None:
                return window
            self._open_len = cost
            window = self._window_to_close(len(plan) + cost, len(plan), remaining)
            if not window:
                return 0
            # Unguarded, every token of the window may open another item.
            opening_growth = max(self._max_growth, cost - len(plan) + 1, 1)
            guarded = remaining <= cost + _CLOSING_MARGIN + self._max_growth + 1 + (window - 1) * opening_growth
        if guarded:
            self._guard_next = plan[0]
            tight = remaining <= len(plan) + _CLOSING_MARGIN + self._window_growth(window) + _TIGHT_MARGIN
            self._guard_bits = self._tokens.steady_bits if tight else self._tokens.calm_bits
        return window

    def _stop_if_going_on_cannot_close(self, remaining: int) -> list[int] | None:
        """Complete here, but the grammar may go on (another parallel tool call, say): an empty plan (only stop
        tokens from now on) when what going on costs would not fit in the budget left. Going on is the model's
        choice, guarded here, not growth of the close: it does not count in `_max_growth`."""
        cost = self._continuation_cost(remaining + 64)
        if cost is None:  # nothing but a stop token may follow
            return None
        self._plan_len = self._continue_len = cost
        window = self._window_to_close(cost, cost, remaining)
        if not window:
            return []
        self._window = window
        self._next_check = self._num_spent + window
        return None


def _has_bit(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    word, bit = divmod(token_id, 32)
    return bool((int(bitmask[row, word]) >> bit) & 1)


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
