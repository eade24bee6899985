"""The xgrammar backend: EBNF, regex, choices, structural tags (tool calls), and JSON schemas it enforces exactly.

xgrammar compiles in spawned worker processes (`ProcessCompilePool`), so a
compilation past its time limit is killed rather than left running; the
compiled grammar comes back serialized and is rebuilt here against the
tokenizer. xgrammar silently ignores JSON-schema keywords it does not
implement, so `unsupported` names any keyword outside the set it enforces.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import xgrammar as xgr
from loraplex.grammar.backends.compile_pool import ProcessCompilePool
from loraplex.grammar.backends.protocol import (
    TokenizerContext,
    TokenVocabulary,
    Unsupported,
    UnsupportedSchemaError,
)
from loraplex.grammar.schema.walk import first_keyword_outside
from loraplex.grammar.spec import GrammarKind, choice_ebnf

# Keywords xgrammar enforces exactly (the JSON Schema instance test measures this).
XGRAMMAR_EXACT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
    "pattern", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "format",
})
XGRAMMAR_EXACT_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "ipv4", "ipv6", "uuid", "uri", "uri-reference",
})
_XGRAMMAR_VERSION = importlib.metadata.version("xgrammar")  # keys the disk cache: another version recompiles
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def clean_xgrammar_message(exc: BaseException) -> str:
    """xgrammar's C++ errors start with a timestamp and source path; users need only the reason."""
    return _LOG_PREFIX.sub("", str(exc)).strip()


def _compile_json_schema(compiler: xgr.GrammarCompiler, schema: Any) -> xgr.CompiledGrammar:
    # No free whitespace: a small model otherwise loves to spend its budget on newlines.
    return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)


def _compile_json_object(compiler: xgr.GrammarCompiler, _: Any) -> xgr.CompiledGrammar:
    return compiler.compile_json_schema({"type": "object"}, any_whitespace=False, strict_mode=False)


_COMPILERS: dict[str, Callable[[xgr.GrammarCompiler, Any], xgr.CompiledGrammar]] = {
    GrammarKind.JSON_OBJECT: _compile_json_object,
    GrammarKind.JSON_SCHEMA: _compile_json_schema,
    GrammarKind.REGEX: lambda compiler, pattern: compiler.compile_regex(pattern),
    GrammarKind.EBNF: lambda compiler, text: compiler.compile_grammar(text),
    GrammarKind.CHOICE: lambda compiler, choices: compiler.compile_grammar(choice_ebnf(choices)),
    GrammarKind.STRUCTURAL_TAG: lambda compiler, tag: compiler.compile_structural_tag(tag),
}


def worker_setup(tokenizer_info_json: str) -> Callable[[tuple[str, Any]], str]:
    """Runs in a compile worker: one compiler for the tokenizer; each job returns the serialized grammar."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json),
                                   max_threads=1, cache_enabled=False)

    def job(request: tuple[str, Any]) -> str:
        kind, payload = request
        try:
            return _COMPILERS[kind](compiler, payload).serialize_json()
        except Exception as exc:  # C++ errors may not pickle: send the reason as a plain ValueError
            raise ValueError(clean_xgrammar_message(exc)) from None

    return job


class XGrammarBackend:
    name: ClassVar[str] = "xgrammar"
    kinds: ClassVar[frozenset[str]] = frozenset(_COMPILERS)

    def __init__(self, context: TokenizerContext, num_workers: int = 1, queue_timeout_s: float = 60.0) -> None:
        self.context = context
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(context.tokenizer, vocab_size=context.vocab_size)
        info_json = self.tokenizer_info.serialize_json()
        self._tokenizer_fingerprint = hashlib.sha256(info_json.encode("utf-8")).hexdigest()
        self._pool = ProcessCompilePool(worker_setup, (info_json,),
                                        num_workers=num_workers, queue_timeout_s=queue_timeout_s)
        words = (context.vocab_size + 31) // 32
        stop_bits = torch.zeros(words, dtype=torch.int32)
        for token_id in self.tokenizer_info.stop_token_ids:
            stop_bits[token_id // 32] |= _bit_as_int32(token_id % 32)
        self._not_stop_bits = ~stop_bits

    @classmethod
    def unsupported(cls, schema: Any) -> Unsupported | None:
        found = first_keyword_outside(schema, XGRAMMAR_EXACT_KEYWORDS, XGRAMMAR_EXACT_FORMATS)
        return None if found is None else Unsupported(found[0], found[1], cls.name)

    def vocabulary(self) -> TokenVocabulary:
        info = self.tokenizer_info
        token_bytes = [bytes(b) for b in info.decoded_vocab]
        token_bytes += [b""] * (self.context.vocab_size - len(token_bytes))
        stop = list(info.stop_token_ids)
        special = set(getattr(self.context.tokenizer, "all_special_ids", [])) | set(info.special_token_ids) | set(stop)
        return TokenVocabulary(token_bytes, stop, special)

    def compile(self, kind: str, payload: Any, timeout_s: float, *, exact: bool = True) -> XGrammarGrammar:
        if kind == GrammarKind.JSON_SCHEMA and exact:
            problem = self.unsupported(payload)
            if problem is not None:
                raise UnsupportedSchemaError(problem)
        cache = self.context.disk_cache
        key = cache.key(self.name, _XGRAMMAR_VERSION, self._tokenizer_fingerprint, kind,
                        json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)) if cache else ""
        if cache is not None and (stored := cache.get(key)) is not None:
            try:
                return XGrammarGrammar(xgr.CompiledGrammar.deserialize_json(stored, self.tokenizer_info), self)
            except Exception:  # a damaged entry is a miss: compile it and overwrite the entry
                pass
        serialized = self._pool.run((kind, payload), timeout_s)
        compiled = xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)
        if cache is not None:
            cache.put(key, serialized)
        return XGrammarGrammar(compiled, self)

    def close(self) -> None:
        self._pool.close()


class XGrammarGrammar:
    __slots__ = ("_backend", "compiled")
    backend = "xgrammar"

    def __init__(self, compiled: xgr.CompiledGrammar, backend: XGrammarBackend) -> None:
        self.compiled = compiled
        self._backend = backend

    @property
    def memory_size_bytes(self) -> int:
        return self.compiled.memory_size_bytes

    def new_matcher(self) -> XGrammarBackendMatcher:
        return XGrammarBackendMatcher(self.compiled, self._backend)


_MAX_FORCED_CHARS = 2048


class XGrammarBackendMatcher:
    __slots__ = ("_backend", "_matcher", "_terminated")

    def __init__(self, compiled: xgr.CompiledGrammar, backend: XGrammarBackend) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._backend = backend
        self._terminated: bool | None = None  # cached per position

    def accept_token(self, token_id: int) -> bool:
        self._terminated = None
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._terminated = None
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, index=row)

    def is_completed(self) -> bool:
        return self._matcher.is_completed()

    def is_terminated(self) -> bool:
        if self._terminated is None:
            if self._matcher.is_terminated():
                self._terminated = True
            elif not self._matcher.is_completed():
                self._terminated = False
            else:  # complete: terminated when only stop tokens may follow
                row = torch.empty((1, self._backend._not_stop_bits.numel()), dtype=torch.int32)
                self._matcher.fill_next_token_bitmask(row)
                self._terminated = not bool(torch.any(row[0] & self._backend._not_stop_bits))
        return self._terminated

    def forced_token_ids(self) -> list[int]:
        # At most `_MAX_FORCED_CHARS` at a time: a schema's long `const` would otherwise be tokenized and walked
        # whole at every refresh, on the engine's thread; the rest comes once this part is taken.
        text = self._matcher.find_jump_forward_string()[:_MAX_FORCED_CHARS]
        if not text:
            return []
        tokens: list[int] = self._backend.context.tokenizer.encode(text, add_special_tokens=False)
        accepted = 0
        for token in tokens:  # keep the prefix the grammar takes (it always should: the text is forced)
            if not self._matcher.accept_token(token):
                break
            accepted += 1
        self._matcher.rollback(accepted)
        return tokens[:accepted]


def _bit_as_int32(bit: int) -> int:
    value = 1 << bit
    return value - (1 << 32) if value >= 1 << 31 else value
