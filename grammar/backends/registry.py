"""The registry of grammar backends: the only way from a spec to a backend.

Backends register their class by name (`register_backend`); the compiler
builds one of each for its tokenizer (`create_backends`) and asks
`backend_order` which to try for a spec. The `auto` choice:
a JSON schema goes to llguidance (it refuses what it cannot enforce, so what
it compiles is exact, and its compilations take milliseconds). xgrammar as an
exact fallback (every keyword in its enforced set) added 3 of 770 benchmark
schemas and accepted one invalid instance, so it is not tried for an exact
grammar; only a non-strict schema falls back to xgrammar ignoring the keywords
it does not implement (the grammar records what was relaxed).
Every other kind (EBNF, regex, choices, tool-call tags) is xgrammar's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.grammar.backends.llguidance_backend import LLGuidanceBackend
from loraplex.grammar.backends.protocol import (
    BackendType,
    GrammarBackend,
    TokenizerContext,
    TokenVocabulary,
    Unsupported,
)
from loraplex.grammar.backends.xgrammar_backend import XGrammarBackend
from loraplex.grammar.spec import GrammarKind, GrammarSpec

AUTO = "auto"
_JSON_SCHEMA_PREFERENCE = ("llguidance",)
_RELAXED_FALLBACK = "xgrammar"
_DEFAULT_FOR_OTHER_KINDS = "xgrammar"
_VOCABULARY_PREFERENCE = ("xgrammar", "llguidance")  # whose reading of the tokenizer the matchers share

_BUILT_IN: tuple[BackendType, ...] = (LLGuidanceBackend, XGrammarBackend)
GRAMMAR_BACKENDS: dict[str, BackendType] = {backend.name: backend for backend in _BUILT_IN}


def register_backend(backend: BackendType) -> BackendType:
    """Add (or replace) a backend class under its `name`; usable as a class decorator."""
    GRAMMAR_BACKENDS[backend.name] = backend
    return backend


def create_backends(context: TokenizerContext) -> dict[str, GrammarBackend]:
    """One of each registered backend for one tokenizer."""
    return {name: backend(context) for name, backend in GRAMMAR_BACKENDS.items()}


def check_choice(choice: str) -> None:
    if choice != AUTO and choice not in GRAMMAR_BACKENDS:
        raise ValueError(f"unknown grammar backend {choice!r}; known: {sorted(GRAMMAR_BACKENDS)}")


def token_vocabulary(backends: Mapping[str, GrammarBackend]) -> TokenVocabulary:
    """The tokenizer as the backends read it (token bytes, stop and special ids), from the preferred backend."""
    names = [*(n for n in _VOCABULARY_PREFERENCE if n in backends), *backends]
    return backends[names[0]].vocabulary()


def backend_order(spec: GrammarSpec, backends: Mapping[str, Any], choice: str = AUTO) -> list[tuple[str, bool]]:
    """(backend name, exact) pairs to try in order; `exact=False` may ignore unsupported keywords."""
    if spec.kind != GrammarKind.JSON_SCHEMA:
        names = [choice, _DEFAULT_FOR_OTHER_KINDS] if choice != AUTO else [_DEFAULT_FOR_OTHER_KINDS]
        return [(name, True) for name in dict.fromkeys(names)
                if name in backends and spec.kind in backends[name].kinds][:1]
    names = [choice] if choice != AUTO else list(_JSON_SCHEMA_PREFERENCE)
    order = [(name, True) for name in names if name in backends]
    relaxed = choice if choice != AUTO else _RELAXED_FALLBACK
    if not spec.strict and relaxed == _RELAXED_FALLBACK and relaxed in backends:
        order.append((relaxed, False))
    return order


def unenforced_in(kind: str, schema: Any, choice: str = AUTO) -> Unsupported | None:
    """The first keyword of a JSON schema embedded in a `kind` grammar (a tool's parameters in a tool-call tag)
    that the backend compiling that kind would not enforce exactly; None when it enforces all of it."""
    spec = GrammarSpec(kind, None)
    order = backend_order(spec, GRAMMAR_BACKENDS, choice)
    if not order:
        return Unsupported("schema", "#", choice, f"no grammar backend compiles {kind}")
    return GRAMMAR_BACKENDS[order[0][0]].unsupported(schema)
