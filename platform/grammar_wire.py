"""How a request's grammar crosses to the engine-core process: as its GrammarSpec, compiled again there.

Compiled xgrammar objects are not plain data. The API server has compiled the
grammar already (a bad one is a 400 before anything is queued); the core
compiles the same spec from its own cache, keyed by the spec's content, and
gates it behind the think block when the API server did.
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.engine.interfaces import CompiledGrammar
from loraplex.engine.protocol import ReasoningMarkers
from loraplex.grammar.compiler import GrammarCompilerService
from loraplex.grammar.runtime.matcher import StructuredGrammar
from loraplex.grammar.runtime.reasoning_gate import ReasoningGatedGrammar
from loraplex.grammar.spec import GrammarSpec


class SpecGrammarCodec:
    """engine.interfaces.GrammarCodec; `compiler` is needed only where grammars are decoded (the core)."""

    def __init__(self, compiler: GrammarCompilerService | None = None) -> None:
        self.compiler = compiler

    def encode(self, grammar: CompiledGrammar) -> str:
        gated = isinstance(grammar, ReasoningGatedGrammar)
        inner = grammar.inner if isinstance(grammar, ReasoningGatedGrammar) else grammar
        if not isinstance(inner, StructuredGrammar):  # what the platform's compiler builds
            raise TypeError(f"cannot send a {type(inner).__name__} to the engine core")
        spec = inner.spec
        return json.dumps({"kind": spec.kind, "payload": spec.payload, "param": spec.param, "strict": spec.strict,
                           "gated": gated})

    def decode(self, text: str, reasoning: ReasoningMarkers | None) -> CompiledGrammar:
        if self.compiler is None:
            raise RuntimeError("this process compiles no grammars")
        data: dict[str, Any] = json.loads(text)
        # `strict` crosses too: a strict schema must never come back relaxed (and it keys the cache).
        spec = GrammarSpec(data["kind"], data["payload"], data["param"], strict=bool(data.get("strict", True)))
        compiled = self.compiler.compile_blocking(spec)
        if data["gated"] and reasoning is not None:
            return ReasoningGatedGrammar(compiled, reasoning)
        return compiled
