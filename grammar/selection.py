"""Which backend serves a spec, in order of preference: the `auto` choice.

A JSON schema goes to llguidance (it refuses what it cannot enforce, so what
it compiles is exact, and its compilations take milliseconds). xgrammar as an
exact fallback (every keyword in its enforced set) added 3 of 770 benchmark
schemas and accepted one invalid instance, so it is not tried for an exact
grammar; only a non-strict schema falls back to xgrammar ignoring the keywords
it does not implement (the grammar records what was relaxed).
Every other kind (EBNF, regex, choices, tool-call tags) is xgrammar's.
"""

from __future__ import annotations

from collections.abc import Mapping

from loraplex.grammar.backend import GrammarBackend
from loraplex.grammar.spec import GrammarKind, GrammarSpec

AUTO = "auto"
_JSON_SCHEMA_PREFERENCE = ("llguidance",)
_RELAXED_FALLBACK = "xgrammar"
_DEFAULT_FOR_OTHER_KINDS = "xgrammar"


def backend_order(spec: GrammarSpec, backends: Mapping[str, GrammarBackend], choice: str = AUTO) -> list[tuple[str, bool]]:
    """(backend name, exact) pairs to try in order; `exact=False` may ignore unsupported keywords."""
    if spec.kind != GrammarKind.JSON_SCHEMA:
        names = [choice, _DEFAULT_FOR_OTHER_KINDS] if choice != AUTO else [_DEFAULT_FOR_OTHER_KINDS]
        return [(name, True) for name in dict.fromkeys(names) if spec.kind in backends[name].kinds][:1]
    names = [choice] if choice != AUTO else list(_JSON_SCHEMA_PREFERENCE)
    order = [(name, True) for name in names if name in backends]
    relaxed = choice if choice != AUTO else _RELAXED_FALLBACK
    if not spec.strict and relaxed == _RELAXED_FALLBACK:
        order.append((relaxed, False))
    return order
