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
"""

from __future__ import annotations

import torch
from loraplex.grammar.backends.protocol import BackendGrammar, BackendMatcher
from loraplex.grammar.runtime.closing import ClosingTokens, continuation_cost, plan_completion
from loraplex.grammar.spec import GrammarSpec

_CLOSING_MARGIN = 2      # tokens of slack: one calm token may add a token or two to the close
_GUARD_MARGIN = 16       # this close to the plan's length, tokens that open new items are masked
_CHECK_EVERY = 8         # far from the end, re-measure the closing plan this often
_TIGHT_MARGIN = 4        # this close to the plan's length, tokens that open anything at all are masked


class StructuredGrammar:
    """A compiled grammar plus what every matcher of it needs; shared by all requests with its spec."""

    __slots__ = ("backend", "closing_tokens", "compile_ms", "inner", "relaxed", "spec", "stop_token_ids")

    def __init__(self, spec: GrammarSpec, inner: BackendGrammar, compile_ms: float,
                 closing_tokens: ClosingTokens, stop_token_ids: list[int], relaxed: str | None = None) -> None:
        self.spec = spec
        self.relaxed = relaxed  # what a non-strict schema lost, when no backend enforces all of it
        self.inner = inner
        self.backend = inner.backend
        self.compile_ms = compile_ms
        self.closing_tokens = closing_tokens
        self.stop_token_ids = stop_token_ids

    @property
    def memory_size_bytes(self) -> int:
        return self.inner.memory_size_bytes

    def new_matcher(self) -> StructuredMatcher:
        return StructuredMatcher(self.inner.new_matcher(), self.closing_tokens, self.stop_token_ids)


class StructuredMatcher:
    """One choice's position in its grammar, with the forced-token queue and the token budget."""

    __slots__ = (
        "_budget",
        "_closing",
        "_continue_len",
        "_guard_bits",
        "_guard_next",
        "_inner",
        "_last_check",
        "_max_growth",
        "_num_spent",
        "_open_len",
        "_plan_len",
        "_queue",
        "_stop_token_ids",
        "_tokens",
    )

    def __init__(self, inner: BackendMatcher, tokens: ClosingTokens, stop_token_ids: list[int]) -> None:
        self._inner = inner
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
        self._guard_next: int | None = None  # near the end: the plan's next token (openers masked)
        self._guard_bits: torch.Tensor | None = None  # the tokens allowed beside it
        self._last_check = -_CHECK_EVERY
        self._refresh()

    # ---- engine protocol ------------------------------------------------------------------
    def accept_token(self, token_id: int) -> bool:
        if self._inner.is_terminated() or not self._inner.accept_token(token_id):
            return False
        self._num_spent += 1
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
            if self._guard_next is not None and self._guard_bits is not None:  # set together
                bitmask[row] &= self._guard_bits
                _set_bit(bitmask, row, self._guard_next)

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (a `length` finish here still ends valid output)."""
        return self._inner.is_completed()

    def forced_token_ids(self) -> list[int]:
        """The tokens that will be forced next, in order: the engine may append them without sampling."""
        return list(self._queue)

    def set_token_budget(self, max_tokens: int) -> None:
        """The most output tokens this choice may produce; near it, the matcher closes the document."""
        self._budget = max_tokens
        if not self._queue or not self._closing:
            self._queue.clear()
            self._refresh()

    def spend_tokens(self, num_tokens: int) -> None:
        """Output tokens spent outside this grammar (a reasoning block before the answer)."""
        self._num_spent += num_tokens

    def closed_by_budget(self) -> bool:
        """True when the budget forced the close: the finish is `length`, though the output is complete."""
        return self._closing

    # ---- the queue ------------------------------------------------------------------------
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
            self._queue = self._inner.forced_token_ids()

    def _closing_plan(self) -> list[int] | None:
        """The closing plan when the budget left is about what closing takes; None while there is room."""
        if self._budget is None or self._closing:
            return None
        remaining = self._budget - self._num_spent
        going_on = max(self._plan_len, self._open_len, self._continue_len or 0)
        near = remaining <= 2 * going_on + _GUARD_MARGIN + self._max_growth + 8
        if remaining <= 0:
            return None
        # A complete match is checked until what going on from it costs is known: another tool call may cost as
        # much as the first; free text after an optional call, one token.
        unmeasured = self._continue_len is None and self._inner.is_completed()
        if not near and self._num_spent - self._last_check < _CHECK_EVERY and not unmeasured:
            return None
        stepped = self._num_spent - self._last_check == 1
        self._last_check = self._num_spent
        plan = plan_completion(self._inner, self._tokens, limit=remaining + 64)
        if plan is None:
            return None
        if not plan:
            return self._stop_if_going_on_cannot_close(remaining)
        if stepped:
            self._max_growth = max(self._max_growth, len(plan) - self._plan_len + 1)
        self._plan_len = len(plan)
        if len(plan) + _CLOSING_MARGIN + self._max_growth >= remaining:
            return plan
        if self._opening_would_not_fit(plan, remaining):
            self._guard_next = plan[0]
            tight = remaining <= len(plan) + _CLOSING_MARGIN + self._max_growth + _TIGHT_MARGIN
            self._guard_bits = self._tokens.steady_bits if tight else self._tokens.calm_bits
        return None

    def _opening_would_not_fit(self, plan: list[int], remaining: int) -> bool:
        """Near the end: a new item (array element, property) opened now might not close in the budget left.
        Within the guard margin that is assumed; beyond it, the cost of opening one is measured where the
        grammar allows it (an item can cost more than the margin: a whole object of required properties)."""
        if remaining <= len(plan) + _GUARD_MARGIN + self._max_growth:
            return True
        cost = continuation_cost(self._inner, self._tokens, limit=remaining + 64, opening=True)
        if cost is None:
            return False
        self._open_len = cost
        return remaining <= cost + _CLOSING_MARGIN + self._max_growth + 1

    def _stop_if_going_on_cannot_close(self, remaining: int) -> list[int] | None:
        """Complete here, but the grammar may go on (another parallel tool call, say): an empty plan (only stop
        tokens from now on) when what going on costs would not fit in the budget left. Going on is the model's
        choice, guarded here, not growth of the close: it does not count in `_max_growth`."""
        cost = continuation_cost(self._inner, self._tokens, limit=remaining + 64)
        if cost is None:  # nothing but a stop token may follow
            return None
        self._plan_len = self._continue_len = cost
        if cost + _CLOSING_MARGIN + self._max_growth >= remaining:
            return []
        return None


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
