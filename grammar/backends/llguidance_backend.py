"""The llguidance backend: JSON schemas, enforced exactly or refused.

llguidance refuses every keyword it does not implement (instead of ignoring
it), so a schema it compiles is enforced as written. Its grammars build their
lexer lazily while masks are computed, and all of that work is bounded by the
fuel limits in `LLParserLimits`, checked inside llguidance itself: a hostile
schema runs out of fuel and errors rather than running on.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, ClassVar

import llguidance
import llguidance.hf
import torch
from loraplex.grammar.backends.array_lark import array_lark
from loraplex.grammar.backends.integer_lark import integer_lark
from loraplex.grammar.backends.object_lark import object_lark
from loraplex.grammar.backends.protocol import (
    TokenizerContext,
    TokenVocabulary,
    Unsupported,
    UnsupportedSchemaError,
)
from loraplex.grammar.backends.string_lark import string_schema_lark
from loraplex.grammar.schema.walk import keyword_path, subschemas
from loraplex.grammar.spec import GrammarKind

if TYPE_CHECKING:  # declared in llguidance's type stubs only
    from llguidance._lib import JsonCompileOptions

# Same output shape as the xgrammar backend: `{"a": 1, "b": 2}`, no other whitespace.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[([^\]]*)\]')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (.+)")
_PROBE_STEPS = 6


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(
        max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
        step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
    )


def _unsupported_from_error(schema: Any, error: str) -> Unsupported | None:
    """llguidance's error names the keyword but not the place: find the place in the schema."""
    match = _UNIMPLEMENTED.search(error)
    if match:
        keyword = json.loads(f"[{match.group(1)}]")[0]
        return Unsupported(keyword, keyword_path(schema, keyword) or "#", "llguidance")
    match = _UNKNOWN_FORMAT.search(error)
    if match:
        fmt = match.group(1).strip().splitlines()[0]
        return Unsupported(f"format: {fmt}", _format_path(schema, fmt), "llguidance")
    first_line = error.splitlines()[0] if error else "refused"
    for keyword in ("oneOf", "patternProperties", "minProperties", "maxProperties", "propertyNames"):
        if keyword in error and ("not supported" in error or "only supported" in error or "disjoint" in error):
            return Unsupported(keyword, keyword_path(schema, keyword) or "#", "llguidance", first_line)
    if "regex" in error or "lookaround" in error:
        return Unsupported("pattern", keyword_path(schema, "pattern") or "#", "llguidance", first_line)
    return None


def _format_path(schema: Any, fmt: str) -> str:
    for path, node, _ in subschemas(schema):
        if isinstance(node, dict) and node.get("format") == fmt:
            return path
    return "#"


class LLGuidanceBackend:
    name: ClassVar[str] = "llguidance"
    kinds: ClassVar[frozenset[str]] = frozenset({GrammarKind.JSON_SCHEMA})

    def __init__(self, context: TokenizerContext) -> None:
        self.context = context
        self.tokenizer = llguidance.hf.from_tokenizer(context.tokenizer, n_vocab=context.vocab_size)
        self.words = (context.vocab_size + 31) // 32
        stop_bits = torch.zeros(self.words, dtype=torch.int32)
        for token_id in self.tokenizer.eos_tokens:
            word, bit = divmod(token_id, 32)
            value = (int(stop_bits[word]) & 0xFFFFFFFF) | (1 << bit)
            stop_bits[word] = value - (1 << 32) if value >= 1 << 31 else value
        self.not_stop_bits = ~stop_bits

    @classmethod
    def unsupported(cls, schema: Any) -> Unsupported | None:
        return None  # llguidance refuses what it cannot enforce when it compiles

    def vocabulary(self) -> TokenVocabulary:
        size = self.tokenizer.vocab_size
        token_bytes = [self.tokenizer.decode_bytes([i]) for i in range(size)]
        token_bytes += [b""] * (self.context.vocab_size - size)
        stop = list(self.tokenizer.eos_tokens)
        special = {i for i in range(size) if self.tokenizer.is_special_token(i)} | set(stop)
        return TokenVocabulary(token_bytes, stop, special)

    def compile(self, kind: str, payload: Any, timeout_s: float, *, exact: bool = True) -> LLGuidanceGrammar:
        if kind != GrammarKind.JSON_SCHEMA:
            raise ValueError(f"llguidance does not compile {kind}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(payload, defaults=_JSON_OPTIONS)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            error = matcher.get_error()
            # A string-only schema as one terminal (`&`, `~`), an object schema as its members (`object_lark`),
            # an array schema with `contains` as its items (`array_lark`), integers as their digits (`integer_lark`).
            lark = (string_schema_lark(payload) or object_lark(payload) or array_lark(payload)
                    or integer_lark(payload))
            if lark is not None:
                grammar = llguidance.LLMatcher.grammar_from_lark(lark)
                matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
                if not matcher.is_error() and self._survives_first_steps(matcher):
                    return LLGuidanceGrammar(matcher, len(grammar), self)
            # Whatever llguidance refuses, another backend may still enforce exactly: never a hard error here.
            problem = _unsupported_from_error(payload, error) or Unsupported(
                "schema", "#", self.name, error.splitlines()[0] if error else "refused")
            raise UnsupportedSchemaError(problem)
        return LLGuidanceGrammar(matcher, len(grammar), self)

    def close(self) -> None:
        return None

    def _survives_first_steps(self, matcher: llguidance.LLMatcher) -> bool:
        """A few masks along one path, on a copy: a terminal whose `&`/`~` derivatives blow up fails here,
        at compile time, rather than in the middle of a generation."""
        probe = matcher.deep_copy()
        row = torch.zeros((1, self.words), dtype=torch.int32)
        for _ in range(_PROBE_STEPS):
            _fill_row(probe, row, 0)
            if probe.is_error() or probe.is_stopped():
                break
            allowed = torch.nonzero(row[0] & self.not_stop_bits)
            if not len(allowed):
                break
            word = int(allowed[0])
            bits = int(row[0, word] & self.not_stop_bits[word]) & 0xFFFFFFFF
            probe.consume_token(word * 32 + (bits & -bits).bit_length() - 1)
        return not probe.is_error()


def _fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """`llguidance.torch.fill_next_token_bitmask`, without importing `llguidance.torch`: that module compiles a
    kernel with `torch.compile` when imported, which loads torch's compiler stack (~5 CPU-seconds in every
    process that serves grammars). llguidance writes the row through a raw pointer, so what it gets is checked
    as there: an int32 row in contiguous host memory."""
    words = bitmask[row]
    if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not words.is_contiguous():
        raise ValueError("an llguidance mask row must be contiguous int32 host memory")
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


class LLGuidanceGrammar:
    __slots__ = ("_backend", "_pristine", "memory_size_bytes")
    backend = "llguidance"

    def __init__(self, pristine: llguidance.LLMatcher, size: int, backend: LLGuidanceBackend) -> None:
        self._pristine = pristine
        self.memory_size_bytes = size
        self._backend = backend

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._pristine.deep_copy(), self._backend)


class LLGuidanceMatcher:
    __slots__ = ("_backend", "_matcher", "_terminated")

    def __init__(self, matcher: llguidance.LLMatcher, backend: LLGuidanceBackend) -> None:
        self._matcher = matcher
        self._backend = backend
        self._terminated: bool | None = None

    def accept_token(self, token_id: int) -> bool:
        # A refused token would leave llguidance's matcher in its error state for good; the
        # engine protocol wants a refusal that changes nothing (the reasoning gate relies on it).
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        self._terminated = None
        return self._matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._terminated = None
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _fill_row(self._matcher, bitmask, row)

    def is_completed(self) -> bool:
        return self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        if self._terminated is None:
            if self._matcher.is_error():
                self._terminated = False
            elif self._matcher.is_stopped():
                self._terminated = True
            elif not self._matcher.is_accepting():
                self._terminated = False
            else:
                row = torch.empty((1, self._backend.words), dtype=torch.int32)
                _fill_row(self._matcher, row, 0)
                self._terminated = not bool(torch.any(row[0] & self._backend.not_stop_bits))
        return self._terminated

    def forced_token_ids(self) -> list[int]:
        return list(self._matcher.compute_ff_tokens())
