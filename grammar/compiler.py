"""Compiles grammar specs with xgrammar, off the engine thread, once per distinct spec.

The cache holds compile *futures* keyed by the spec's canonical JSON, so a
burst of identical requests compiles once and every request awaits the same
future. xgrammar releases the GIL while it compiles, so the engine loop keeps
stepping the rest of the batch. A compilation that runs longer than
`compile_timeout_s` (time queued behind others does not count), or a spec past
the size limits, gets a 400 that names the request field.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr
from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.matcher import XGrammarCompiledGrammar
from loraplex.grammar.spec import GrammarKind, GrammarSpec, choice_ebnf


@dataclass(slots=True)
class GrammarLimits:
    # xgrammar expands bounded repetitions: a string with maxLength 60 alone takes ~1.5 s here.
    compile_timeout_s: float = 30.0
    max_spec_bytes: int = 256 * 1024           # canonical JSON of the spec
    max_compiled_bytes: int = 256 * 1024 * 1024  # xgrammar's own estimate of the compiled grammar
    max_cached_grammars: int = 1024
    num_compile_threads: int = 2


@dataclass(slots=True, eq=False)
class _Compilation:
    future: Future[XGrammarCompiledGrammar]
    started_at: float | None = None  # monotonic; None while queued behind other compilations


class GrammarCompilerService:
    """One per served tokenizer; thread-safe; shared by every request."""

    def __init__(self, tokenizer: Any, vocab_size: int, limits: GrammarLimits | None = None) -> None:
        self.limits = limits or GrammarLimits()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar's own cache is off: ours is keyed by content and also remembers failures.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(
            max_workers=self.limits.num_compile_threads, thread_name_prefix="grammar-compile"
        )
        self._compilations: OrderedDict[str, _Compilation] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations actually run (cache misses)

    def submit(self, spec: GrammarSpec) -> Future[XGrammarCompiledGrammar]:
        """The future of `spec`'s compiled grammar; starts a compilation only on a cache miss."""
        return self._submit(spec).future

    def _submit(self, spec: GrammarSpec) -> _Compilation:
        self._check_spec_size(spec)
        key = spec.cache_key()
        with self._lock:
            entry = self._compilations.get(key)
            if entry is not None and not entry.future.cancelled():
                self._compilations.move_to_end(key)
                return entry
            entry = _Compilation(Future())
            entry.future = self._pool.submit(self._compile, spec, entry)
            self._compilations[key] = entry
            while len(self._compilations) > self.limits.max_cached_grammars:
                self._compilations.popitem(last=False)
            return entry

    async def compile(self, spec: GrammarSpec) -> XGrammarCompiledGrammar:
        """Await `spec`'s grammar; InvalidRequestError (400) if it is bad, too big or too slow.

        The time limit runs from the moment the compilation starts: a burst of
        distinct schemas queued behind each other is not "too slow".
        """
        entry = self._submit(spec)
        # shield: one caller giving up (disconnect, timeout) must not cancel the shared future.
        waiter = asyncio.shield(asyncio.wrap_future(entry.future))
        while True:
            remaining = self._remaining_s(entry)
            if remaining <= 0:
                raise self._timeout_error(spec)
            done, _ = await asyncio.wait({waiter}, timeout=remaining)
            if done:
                return waiter.result()

    def compile_blocking(self, spec: GrammarSpec) -> XGrammarCompiledGrammar:
        """The same as `compile` for callers without an event loop (CLI, benchmarks, tests)."""
        entry = self._submit(spec)
        while True:
            remaining = self._remaining_s(entry)
            if remaining <= 0:
                raise self._timeout_error(spec)
            try:
                return entry.future.result(timeout=remaining)
            except FutureTimeoutError:
                continue

    def _remaining_s(self, entry: _Compilation) -> float:
        if entry.future.done() or entry.started_at is None:
            return self.limits.compile_timeout_s
        return entry.started_at + self.limits.compile_timeout_s - time.monotonic()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_spec_size(self, spec: GrammarSpec) -> None:
        size = spec.size_bytes()
        if size > self.limits.max_spec_bytes:
            raise InvalidRequestError(
                f"{spec.kind} is too large to compile: {size} bytes, the limit is {self.limits.max_spec_bytes}",
                param=spec.param,
            )

    def _timeout_error(self, spec: GrammarSpec) -> InvalidRequestError:
        return InvalidRequestError(
            f"{spec.kind} took longer than {self.limits.compile_timeout_s:g}s to compile; simplify it",
            param=spec.param,
        )

    def _compile(self, spec: GrammarSpec, entry: _Compilation) -> XGrammarCompiledGrammar:
        entry.started_at = time.monotonic()
        started = time.perf_counter()
        try:
            compiled = _COMPILERS[spec.kind](self._compiler, spec.payload)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError) as exc:
            raise InvalidRequestError(f"invalid {spec.kind}: {clean_xgrammar_message(exc)}", param=spec.param) from exc
        compile_ms = (time.perf_counter() - started) * 1e3
        self.num_compiled += 1
        if compiled.memory_size_bytes > self.limits.max_compiled_bytes:
            raise InvalidRequestError(
                f"{spec.kind} compiles to {compiled.memory_size_bytes} bytes, over the limit of "
                f"{self.limits.max_compiled_bytes}; simplify it",
                param=spec.param,
            )
        return XGrammarCompiledGrammar(spec, compiled, compile_ms)


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def clean_xgrammar_message(exc: BaseException) -> str:
    """xgrammar's C++ errors start with a timestamp and source path; users need only the reason."""
    return _XGRAMMAR_LOG_PREFIX.sub("", str(exc)).strip()


def _compile_json_schema(compiler: xgr.GrammarCompiler, schema: Any) -> xgr.CompiledGrammar:
    # Compact separators and no free whitespace: a small model otherwise loves to
    # spend its whole budget on newlines inside the object.
    return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)


def _compile_json_object(compiler: xgr.GrammarCompiler, _: Any) -> xgr.CompiledGrammar:
    return compiler.compile_json_schema({"type": "object"}, any_whitespace=False, strict_mode=False)


_COMPILERS = {
    GrammarKind.JSON_OBJECT: _compile_json_object,
    GrammarKind.JSON_SCHEMA: _compile_json_schema,
    GrammarKind.REGEX: lambda compiler, pattern: compiler.compile_regex(pattern),
    GrammarKind.EBNF: lambda compiler, text: compiler.compile_grammar(text),
    GrammarKind.CHOICE: lambda compiler, choices: compiler.compile_grammar(choice_ebnf(choices)),
    GrammarKind.STRUCTURAL_TAG: lambda compiler, tag: compiler.compile_structural_tag(tag),
}
