"""A grammar that starts after the model's reasoning: the think block is free text, the answer is constrained.

For a reasoning model a JSON schema constrains the answer, not the thoughts.
The gate lets the model open its think block (or starts inside it, for
templates that open it), leaves the block unconstrained except that it cannot
stop there, and hands every token after the closing marker to the real
matcher. Markers are matched as token ids, as the engine counts reasoning
tokens and forces the closing marker when a thinking budget runs out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from loraplex.engine.protocol import ReasoningMarkers
from loraplex.grammar.runtime.matcher import StructuredGrammar, StructuredMatcher


class ReasoningGatedGrammar:
    __slots__ = ("inner", "markers")

    def __init__(self, inner: StructuredGrammar, markers: ReasoningMarkers) -> None:
        self.inner = inner
        self.markers = markers

    def new_matcher(self) -> ReasoningGatedMatcher:
        return ReasoningGatedMatcher(self.inner.new_matcher(), self.markers, self.inner.stop_token_ids,
                                     fresh_inner=self.inner.new_matcher)


class ReasoningGatedMatcher:
    _BEFORE, _OPENING, _INSIDE, _AFTER = range(4)

    def __init__(self, inner: StructuredMatcher, markers: ReasoningMarkers, stop_token_ids: list[int],
                 fresh_inner: Callable[[], StructuredMatcher] | None = None) -> None:
        self._inner = inner
        # The start marker's first tokens may also begin the answer (`<think>` and `<tool_call>` share `<`):
        # while opening, the answer path stays alive in `_inner`, and a completed marker starts a fresh one.
        self._fresh_inner = fresh_inner
        self._answer_alive = self._inner_fed = False
        self._start = list(markers.start_token_ids)
        self._end = list(markers.end_token_ids)
        self._stop_token_ids = stop_token_ids
        self._state = self._INSIDE if markers.starts_inside else self._BEFORE
        if not self._start and self._state == self._BEFORE:
            self._state = self._AFTER
        self._opened = 0          # tokens of the start marker seen so far
        self._recent: list[int] = []  # the last tokens inside the block, to spot the end marker
        self._budget: int | None = None
        self._phase = 0
        self._num_outside = 0     # tokens the answer grammar did not see (the think block)

    def accept_token(self, token_id: int) -> bool:
        if self._state == self._INSIDE:  # think-block tokens count against the answer's budget too
            self._num_outside += 1
            self._inner.spend_tokens(1)
        elif self._state == self._OPENING or (self._state == self._BEFORE and self._start and token_id == self._start[0]):
            self._num_outside += 1
        if self._state == self._BEFORE:
            if token_id == self._start[0]:
                self._opened = 1
                self._state = self._INSIDE if len(self._start) == 1 else self._OPENING
                self._answer_alive = self._inner_fed = self._state == self._OPENING and self._inner.accept_token(token_id)
                return True
            self._state = self._AFTER  # answered without thinking
            return self._inner.accept_token(token_id)
        if self._state == self._OPENING:
            if token_id != self._start[self._opened]:
                if self._answer_alive and self._inner.accept_token(token_id):
                    self._state = self._AFTER  # it was the answer, not a think block
                    return True
                return False
            self._opened += 1
            self._answer_alive = self._answer_alive and self._inner.accept_token(token_id)
            if self._opened == len(self._start):
                self._state = self._INSIDE
                if self._inner_fed and self._fresh_inner is not None:
                    self._inner = self._fresh_inner()  # the answer path had eaten the marker
                    if self._budget is not None:
                        self._inner.set_token_budget(self._budget, self._phase)
                    self._inner.spend_tokens(self._num_outside)
            return True
        if self._state == self._INSIDE:
            self._recent = [*self._recent, token_id][-len(self._end):] if self._end else []
            if self._end and self._recent == self._end:
                self._state = self._AFTER
            return True
        return self._inner.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state == self._AFTER:
            self._inner.fill_bitmask(bitmask, row)
        elif self._state == self._BEFORE:
            self._inner.fill_bitmask(bitmask, row)
            _set_bit(bitmask, row, self._start[0])
        elif self._state == self._OPENING:
            if self._answer_alive:
                self._inner.fill_bitmask(bitmask, row)
            else:
                bitmask[row].zero_()
            _set_bit(bitmask, row, self._start[self._opened])
        else:
            bitmask[row].fill_(-1)  # free thoughts, but no stopping before the answer
            for token_id in self._stop_token_ids:
                _clear_bit(bitmask, row, token_id)

    def is_terminated(self) -> bool:
        return self._state == self._AFTER and self._inner.is_terminated()

    def is_completed(self) -> bool:
        return self._state == self._AFTER and self._inner.is_completed()

    def forced_token_ids(self) -> list[int]:
        return self._inner.forced_token_ids() if self._state == self._AFTER else []

    def set_token_budget(self, max_tokens: int, phase: int = 0) -> None:
        self._budget, self._phase = max_tokens, phase
        self._inner.set_token_budget(max_tokens, phase)

    def closed_by_budget(self) -> bool:
        return self._state == self._AFTER and self._inner.closed_by_budget()


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = int(bitmask[row, word]) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def _clear_bit(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) & ~(1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
