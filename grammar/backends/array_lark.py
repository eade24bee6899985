"""An array schema with `contains` as an llguidance Lark grammar: items one after another, each embedded JSON.

llguidance's JSON compiler has no `contains` ("some item matches C"), and
the complement of `items` is one (`negate`). An array whose schema is made
of `type: array`, `items` (one schema for every item), `contains`,
`minItems`/`maxItems`, `allOf`, `anyOf` and `$ref` is read in disjunctive
form, each clause a conjunction: the schemas every item meets, the ones some
item meets, the bounds on the count. Each clause is a small automaton over
the items: its state is how many were read (counted as far as a bound needs)
and which `contains` no item has met yet; an item may meet any of those
(its value the `allOf` of what it meets and what every item owes, embedded
as `%json`), and `]` comes only once none is left. Anything else leaves the
schema to the JSON compiler (None).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import llguidance
from loraplex.grammar.backends.clause_algebra import clause_product, connective_clauses
from loraplex.grammar.backends.counted_lark import counted_rules, num_states
from loraplex.grammar.backends.string_lark import Untranslatable
from loraplex.grammar.schema.walk import VALIDATION_KEYWORDS, conjuncts

_MAX_CLAUSES = 16
_MAX_EXISTS = 4       # item kinds: 2 ** contains per clause
_MAX_STATES = 256     # (items read, contains left) per clause
_MAX_DEPTH = 16
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True)
class _Clause:
    low: int = 0
    high: int | None = None
    every: list[Any] = field(default_factory=list)   # schemas every item meets
    some: list[Any] = field(default_factory=list)    # schemas some item meets (one `contains` each)
    is_array: bool = False                           # `type: array` holds in it (no other type passes)

    def merged(self, other: _Clause) -> _Clause:
        highs = [h for h in (self.high, other.high) if h is not None]
        return _Clause(max(self.low, other.low), min(highs) if highs else None, self.every + other.every,
                       self.some + other.some, self.is_array or other.is_array)


def array_lark(schema: Any) -> str | None:
    """A Lark grammar for an array schema made of the keywords above, with some `contains`; None otherwise."""
    parts = conjuncts(schema, schema) if isinstance(schema, dict) else None
    if parts is None or not any(_mentions_contains(part) for part in parts):
        return None
    try:
        clauses = _Reader(schema).clauses(schema, 0)
        if not clauses or not all(c.is_array for c in clauses):
            return None  # other types would pass the array keywords: left to the JSON compiler
        return _Writer(schema).grammar(clauses)
    except Untranslatable:
        return None


def _mentions_contains(node: dict[str, Any]) -> bool:
    return '"contains"' in json.dumps(node)


class _Reader:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def clauses(self, node: Any, depth: int) -> list[_Clause]:
        if depth > _MAX_DEPTH or not isinstance(node, dict | bool) or node is False:
            raise Untranslatable
        result = [_Clause()]
        if node is True:
            return result
        for key, value in node.items():
            if key in VALIDATION_KEYWORDS:
                result = clause_product(result, self._keyword(key, value, depth), _MAX_CLAUSES)
        return result

    def _keyword(self, key: str, value: Any, depth: int) -> list[_Clause]:
        count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if key == "type" and value == "array":
            return [_Clause(is_array=True)]
        if key == "minItems" and count:
            return [_Clause(low=value)]
        if key == "maxItems" and count:
            return [_Clause(high=value)]
        if key == "items" and isinstance(value, dict | bool):
            return [_Clause(every=[value])]
        if key == "contains" and isinstance(value, dict | bool):
            return [_Clause(some=[value])]
        combined = connective_clauses(key, value, root=self.root, new=_Clause, most=_MAX_CLAUSES,
                                      read=lambda member: self.clauses(member, depth + 1))
        if combined is None:
            raise Untranslatable  # prefixItems, uniqueItems, minContains, other types' keywords, ...
        return combined


class _Writer:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.rules: list[str] = []
        self.arrays: list[str] = []
        self.values: dict[str, str | None] = {}  # an item's schema (JSON) -> its rule, None when no value meets it

    def grammar(self, clauses: list[_Clause]) -> str | None:
        for clause in clauses:
            self._clause(clause)
        if not self.arrays:
            return None
        return "\n".join([f"start: {' | '.join(dict.fromkeys(self.arrays))}", *self.rules]) + "\n"

    def _clause(self, clause: _Clause) -> None:
        """Items one after another; rule `a{n}_{read}_{left}` is what may follow in that state: `]` once enough
        were read and no contains is left, or `, ` and one more item."""
        some, low, high = clause.some, clause.low, clause.high
        if len(some) > _MAX_EXISTS or num_states(low, high, len(some)) > _MAX_STATES:
            raise Untranslatable
        items = {met: self._item(clause.every + [s for i, s in enumerate(some) if met >> i & 1])
                 for met in range(1 << len(some))}
        rules, openings = counted_rules(items, low, high, prefix=f"a{len(self.rules)}", brackets=("[", "]"),
                                        only_unmet=False)
        self.rules += rules
        self.arrays += openings

    def _item(self, schemas: list[Any]) -> str | None:
        """A rule for an item meeting every schema of `schemas`; None when no value does."""
        if any(s is False for s in schemas):
            return None
        kept = [s for s in schemas if s is not True and s != {}]
        value: dict[str, Any] = {"allOf": kept} if kept else {}
        text = json.dumps(value, sort_keys=True)
        if text not in self.values:
            embedded = {**value, "x-guidance": _JSON_OPTIONS}
            if '"$ref"' in text:
                embedded.update({k: self.root[k] for k in ("definitions", "$defs") if isinstance(self.root.get(k), dict)})
            error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(embedded))
            if error and "nsatisfiable" not in error:
                raise Untranslatable  # an item the JSON compiler refuses (a contains inside an item, ...)
            rule = None
            if not error:
                rule = f"i{len(self.rules)}"
                self.rules.append(f"{rule}: %json {json.dumps(embedded)}")
            self.values[text] = rule
        return self.values[text]
