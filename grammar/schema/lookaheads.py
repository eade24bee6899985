"""`pattern`s with lookaheads (`^(?!.*--)[a-z-]+$`), written as plain regexes of the same strings.

Backends refuse lookarounds. A lookahead outside any unbounded repetition
keeps the language regular: "what follows here matches L" is an intersection
with the rest of the pattern, "does not" one with its complement, and
`regular_dfa.plain_pattern` writes the result without either. The rewritten
pattern is restricted to the strings every reader agrees on (see `regular`);
a pattern it cannot write (lookbehinds, back-references, too large) is left
as it is, and the backend refuses it.
"""

from __future__ import annotations

import copy
from typing import Any

from loraplex.grammar.schema.regular import Unregular, has_lookahead
from loraplex.grammar.schema.regular_dfa import plain_pattern
from loraplex.grammar.schema.walk import subschemas

_NO_STRING = "[^\\s\\S]"  # the regex no string matches, for a pattern whose language is empty


def without_lookaheads(pattern: Any) -> str | None:
    """`pattern` without its lookaheads; None when it has none or cannot be written without them."""
    if not has_lookahead(pattern):
        return None
    try:
        plain = plain_pattern(pattern)
    except Unregular:
        return None
    return _NO_STRING if plain is None else plain


def with_lookaheads_resolved(schema: Any) -> Any:
    """`schema` (a copy when anything changes) with each `pattern` and `patternProperties` key that has a
    lookahead written without it."""
    rewritten: dict[str, str | None] = {}

    def plain(pattern: Any) -> str | None:
        if not isinstance(pattern, str):
            return None
        if pattern not in rewritten:
            rewritten[pattern] = without_lookaheads(pattern)
        return rewritten[pattern]

    def changes(node: Any) -> bool:
        return isinstance(node, dict) and (plain(node.get("pattern")) is not None or (
            isinstance(node.get("patternProperties"), dict) and any(plain(p) for p in node["patternProperties"])))

    if not any(changes(node) for _, node, _ in subschemas(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, node, _ in subschemas(schema):
        if not isinstance(node, dict):
            continue
        if (pattern := plain(node.get("pattern"))) is not None:
            node["pattern"] = pattern
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = _renamed(node["patternProperties"], plain)
    return schema


def _renamed(patterns: dict[str, Any], plain: Any) -> dict[str, Any]:
    """The map with each key rewritten, where that merges no two keys (each keeps its own subschema)."""
    out: dict[str, Any] = {}
    for pattern, sub in patterns.items():
        new = plain(pattern) or pattern
        out[pattern if new in out or (new in patterns and new != pattern) else new] = sub
    return out
