"""Compiles grammar specs through the backend registry, off the request path, once per distinct spec.

The cache holds compile *futures* keyed by the spec's canonical JSON, so a
burst of identical requests compiles once and every request awaits the same
future (per API process). Backends come from `backends.registry`, which
decides which serves a spec (`backend_order`); a JSON schema, once through
the schema passes (`schema.passes`), goes to the first backend that
enforces it exactly. A strict schema that none enforces is a 400 naming the
keyword and where it is; a non-strict one is served by the backend that
ignores the least, and the grammar says what was relaxed (`relaxed`).

Time limits: xgrammar compiles in worker processes that are killed past
`compile_timeout_s`; llguidance bounds its own work with fuel limits. A
request waits for a compile thread and worker at most `queue_timeout_s` more.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.backends.disk_cache import GrammarDiskCache
from loraplex.grammar.backends.ebnf_productivity import unfinishable_rules
from loraplex.grammar.backends.protocol import GrammarBackend, TokenizerContext, UnsupportedSchemaError
from loraplex.grammar.backends.registry import backend_order, check_choice, create_backends, token_vocabulary
from loraplex.grammar.runtime.closing import ClosingTokens, unfinishable
from loraplex.grammar.runtime.matcher import StructuredGrammar
from loraplex.grammar.runtime.unique_items import TokenBytes, UniqueItemsGrammar
from loraplex.grammar.schema.passes import prepare_schema
from loraplex.grammar.schema.productive import NO_FINITE_VALUE, admits_no_finite_value
from loraplex.grammar.spec import GrammarKind, GrammarSpec


@dataclass(slots=True)
class GrammarLimits:
    compile_timeout_s: float = 30.0
    queue_timeout_s: float = 60.0               # waiting for a compile thread / worker, on top
    max_spec_bytes: int = 256 * 1024            # canonical JSON of the spec
    max_compiled_bytes: int = 256 * 1024 * 1024  # the backend's own estimate of the compiled grammar
    max_cached_grammars: int = 1024
    num_compile_threads: int = 2
    max_schema_depth: int = 64                  # nesting of JSON-schema subschemas
    max_schema_nodes: int = 20000               # subschemas in one JSON schema
    max_tools: int = 128                        # `tools` entries in one request
    backend: str = "auto"                       # auto, or a registered backend name for every spec
    cache_dir: str | None = None                # compiled grammars shared across processes (GrammarDiskCache)
    # A grammar forcing more tokens than this without a choice is refused (see _check_finishable)
    max_completion_tokens: int = 8192


class GrammarCompilerService:
    """One per served tokenizer; thread-safe; shared by every request of the process."""

    def __init__(self, tokenizer: Any, vocab_size: int, limits: GrammarLimits | None = None) -> None:
        self.limits = limits or GrammarLimits()
        self.vocab_size = vocab_size
        disk_cache = GrammarDiskCache(self.limits.cache_dir) if self.limits.cache_dir else None
        check_choice(self.limits.backend)
        self.backends: dict[str, GrammarBackend] = create_backends(TokenizerContext(tokenizer, vocab_size, disk_cache))
        vocabulary = token_vocabulary(self.backends)
        self.stop_token_ids = vocabulary.stop_token_ids
        self.closing_tokens = ClosingTokens(vocabulary.token_bytes, vocabulary.special_token_ids, vocab_size,
                                            encode=_encoder(tokenizer))
        self._vocabulary = vocabulary
        self._token_bytes: TokenBytes | None = None  # built on the first schema with checked uniqueItems
        self._pool = ThreadPoolExecutor(max_workers=self.limits.num_compile_threads, thread_name_prefix="grammar-compile")
        self._compilations: OrderedDict[str, Future[StructuredGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations actually run (cache misses)

    def submit(self, spec: GrammarSpec) -> Future[StructuredGrammar]:
        """The future of `spec`'s compiled grammar; starts a compilation only on a cache miss."""
        self._check_spec_size(spec)
        key = spec.cache_key()
        with self._lock:
            future = self._compilations.get(key)
            if future is not None and not future.cancelled():
                self._compilations.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._compilations[key] = future
            while len(self._compilations) > self.limits.max_cached_grammars:
                self._compilations.popitem(last=False)
            return future

    async def compile(self, spec: GrammarSpec) -> StructuredGrammar:
        """Await `spec`'s grammar; InvalidRequestError (400) if it is bad, unsupported, too big or too slow."""
        future = self.submit(spec)
        # shield: one caller giving up (disconnect, timeout) must not cancel the shared future.
        waiter = asyncio.shield(asyncio.wrap_future(future))
        try:
            return await asyncio.wait_for(waiter, timeout=self._deadline_s())
        except TimeoutError:
            raise self._timeout_error(spec) from None

    def compile_blocking(self, spec: GrammarSpec) -> StructuredGrammar:
        """The same as `compile` for callers without an event loop (CLI, benchmarks, tests, the engine core)."""
        try:
            return self.submit(spec).result(timeout=self._deadline_s())
        except FutureTimeoutError:
            raise self._timeout_error(spec) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for backend in self.backends.values():
            backend.close()

    def _get_token_bytes(self) -> TokenBytes:
        with self._lock:
            if self._token_bytes is None:
                self._token_bytes = TokenBytes(self._vocabulary.token_bytes)
            return self._token_bytes

    def _deadline_s(self) -> float:
        return self.limits.compile_timeout_s + self.limits.queue_timeout_s

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

    def _compile(self, spec: GrammarSpec) -> StructuredGrammar:
        first_refusal: UnsupportedSchemaError | None = None
        payload = spec.payload
        unique_items = None
        if spec.kind == GrammarKind.JSON_SCHEMA:
            # The same language, in words the backends know (schema.passes.SCHEMA_PASSES, in order).
            try:
                prepared = prepare_schema(payload)
            except RecursionError:  # its nesting was bounded at the edge (walk.value_nesting_limit); a last guard
                raise InvalidRequestError(f"{spec.param} nests too deep to compile; simplify it",
                                          param=spec.param) from None
            if prepared.schema is False and admits_no_finite_value(payload):
                raise InvalidRequestError(f"{spec.param} cannot be satisfied: {NO_FINITE_VALUE}", param=spec.param)
            if prepared.schema is False:
                raise InvalidRequestError(
                    f"{spec.param} cannot be enforced exactly: keyword 'schema' at # accepts no JSON value "
                    "(its constraints contradict each other)", param=spec.param)
            payload, unique_items = prepared.schema, prepared.unique_items
        elif spec.kind == GrammarKind.EBNF:
            self._check_rules_finish(spec)
        for name, exact in backend_order(spec, self.backends, self.limits.backend):
            backend = self.backends[name]
            started = time.perf_counter()
            try:
                inner = backend.compile(spec.kind, payload, self.limits.compile_timeout_s, exact=exact)
            except UnsupportedSchemaError as exc:
                first_refusal = first_refusal or exc
                continue
            except TimeoutError:
                raise self._timeout_error(spec) from None
            except (ValueError, RuntimeError, TypeError) as exc:
                raise InvalidRequestError(f"invalid {spec.kind}: {exc}", param=spec.param) from None
            compile_ms = (time.perf_counter() - started) * 1e3
            self.num_compiled += 1
            if inner.memory_size_bytes > self.limits.max_compiled_bytes:
                raise InvalidRequestError(
                    f"{spec.kind} compiles to {inner.memory_size_bytes} bytes, over the limit of "
                    f"{self.limits.max_compiled_bytes}; simplify it",
                    param=spec.param,
                )
            self._check_finishable(spec, inner)
            relaxed = None if exact or first_refusal is None else first_refusal.unsupported.message()
            if unique_items is not None:
                inner = UniqueItemsGrammar(inner, unique_items, self._get_token_bytes())
            return StructuredGrammar(spec, inner, compile_ms, self.closing_tokens, self.stop_token_ids,
                                     relaxed=relaxed)
        message = first_refusal.unsupported.message() if first_refusal else f"no grammar backend compiles {spec.kind}"
        raise InvalidRequestError(
            f"{spec.param} cannot be enforced exactly: {message}; remove it, or set strict to false "
            "to have it relaxed",
            param=spec.param,
        )

    @staticmethod
    def _check_rules_finish(spec: GrammarSpec) -> None:
        """400 for an EBNF grammar with a reachable rule that never finishes, before any backend sees it: its
        forced text would go on without end, and xgrammar's jump-forward never returns on it."""
        unfinishable = unfinishable_rules(spec.payload) if isinstance(spec.payload, str) else None
        if unfinishable:
            names = ", ".join(repr(name) for name in unfinishable[:5])
            raise InvalidRequestError(
                f"{spec.param} cannot be satisfied: no text ever completes rule {names} (every way through it "
                "refers back to a rule that never ends)", param=spec.param)

    def _check_finishable(self, spec: GrammarSpec, inner: Any) -> None:
        """400 when no output can complete the grammar. A schema can be well formed and admit no finite JSON
        value (`{"$ref": "#"}`, two definitions referring only to each other, a required property whose schema
        is its parent's): its grammar allows no token but a stop token, or forces an endless chain, and without
        this check the request ran and answered an empty "stop" that is no JSON, or ran to its token limit.
        Checked once per compiled grammar, on a matcher of its own, following only forced tokens (cheap)."""
        reason = unfinishable(inner.new_matcher(), self.closing_tokens, self.limits.max_completion_tokens)
        if reason is not None:
            raise InvalidRequestError(
                f"{spec.param} cannot be satisfied: {reason} (does a required part refer back to itself, or a "
                "reference to another that never ends?)", param=spec.param)


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Text to token ids without special tokens; the Rust tokenizer directly where there is one (no Python
    wrapper state shared between threads)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: tokenizer.encode(text, add_special_tokens=False)
