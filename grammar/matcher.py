"""The engine-facing grammar objects (`engine.interfaces.CompiledGrammar` / `GrammarMatcher`).

A choice ends the moment its grammar is complete and nothing but a stop token
could follow: the sampler never spends a step on the EOS token and no text
can trail the JSON. Grammars that are complete yet could go on (a regex like
`[a-z]+`) keep going until the model picks a stop token.
"""

from __future__ import annotations

import torch
import xgrammar as xgr
from loraplex.grammar.spec import GrammarSpec


class XGrammarCompiledGrammar:
    """A compiled grammar plus what every matcher of it needs; shared by all requests with its spec."""

    __slots__ = ("_stop_bits", "compile_ms", "spec", "stop_token_ids", "xgr_grammar")

    def __init__(self, spec: GrammarSpec, xgr_grammar: xgr.CompiledGrammar, compile_ms: float) -> None:
        self.spec = spec
        self.xgr_grammar = xgr_grammar
        self.compile_ms = compile_ms
        info = xgr_grammar.tokenizer_info
        self.stop_token_ids = list(info.stop_token_ids)
        bits = torch.zeros(xgr.get_bitmask_shape(1, info.vocab_size)[1], dtype=torch.int32)
        for token_id in info.stop_token_ids:
            word, bit = divmod(token_id, 32)
            bits[word] |= _bit_as_int32(bit)
        self._stop_bits = bits

    @property
    def memory_size_bytes(self) -> int:
        return self.xgr_grammar.memory_size_bytes

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.xgr_grammar, self._stop_bits)


class XGrammarMatcher:
    """One choice's position in its grammar."""

    __slots__ = ("_matcher", "_not_stop_bits", "_pending_row", "_terminated")

    def __init__(self, xgr_grammar: xgr.CompiledGrammar, stop_bits: torch.Tensor) -> None:
        self._matcher = xgr.GrammarMatcher(xgr_grammar)
        self._not_stop_bits = ~stop_bits
        # The next step's mask when accept_token already had to compute it.
        self._pending_row: torch.Tensor | None = None
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        if self._terminated or not self._matcher.accept_token(token_id):
            return False
        self._pending_row = None
        if self._matcher.is_terminated():
            self._terminated = True  # the model chose a stop token the grammar allowed
        elif self._matcher.is_completed():
            row = torch.empty((1, self._not_stop_bits.numel()), dtype=torch.int32)
            self._matcher.fill_next_token_bitmask(row)
            if torch.any(row[0] & self._not_stop_bits):
                self._pending_row = row
            else:
                self._terminated = True
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._pending_row is not None:
            bitmask[row].copy_(self._pending_row[0])
            self._pending_row = None
        elif self._terminated:
            bitmask[row].copy_(~self._not_stop_bits)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, index=row)

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        """The text so far is a complete match (a `length` finish here still ends valid output)."""
        return self._terminated or self._matcher.is_completed()


def _bit_as_int32(bit: int) -> int:
    value = 1 << bit
    return value - (1 << 32) if value >= 1 << 31 else value
