"""An object schema allowing two keys at most, as an llguidance Lark grammar: each key one terminal, each
value an embedded JSON schema.

With `maxProperties` 1 or 2, "some key matches P and its value V" (`not` of a
`patternProperties`, or of a `propertyNames`; `required`) is a constraint on
one of the few members there are: each such constraint is given to a member
(every way of giving them is an alternative), whose key then lies in the
constraint's set and whose value meets its V. llguidance's JSON compiler has
no complement and wants `patternProperties` disjoint; a Lark grammar can say
it: a key is a string terminal (`&`, `~`, as in `string_lark`), a value
`%json{...}`. Every "each key matching C has a value in V" (`properties`,
`patternProperties`, `additionalProperties`) splits the key space in regions
(in C or not), each with the values it owes. `anyOf` over such conditions is
read in disjunctive form, one set of members per clause. Anything else
leaves the schema to the JSON compiler (None). Like llguidance's own object
grammars, two members are not checked for the same key text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import llguidance
from loraplex.grammar.backends.string_lark import StringTerms, Untranslatable
from loraplex.grammar.schema.negate import negate
from loraplex.grammar.schema.walk import VALIDATION_KEYWORDS, resolve_ref

_MAX_CLAUSES = 32
_MAX_CONDITIONS = 5   # regions: 2 ** conditions per member
_MAX_MEMBERS = 2
_MAX_EXISTS = 6       # ways of giving them to two members: 2 ** constraints
_MAX_DEPTH = 16
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True)
class _Clause:
    """One conjunction of constraints on an object of at most two members."""

    low: int = 0
    high: int | None = None
    keys: list[Any] = field(default_factory=list)         # string schemas every key meets
    exists: list[tuple[Any, Any]] = field(default_factory=list)  # (key schema, value schema) some member meets
    # (key schema, value schema owed there, the node it comes from, whether it is that node's
    # additionalProperties: its keys are none of the node's other conditions')
    conditions: list[tuple[Any, Any, int, bool]] = field(default_factory=list)

    def merged(self, other: _Clause) -> _Clause:
        highs = [h for h in (self.high, other.high) if h is not None]
        return _Clause(max(self.low, other.low), min(highs) if highs else None, self.keys + other.keys,
                       self.exists + other.exists, self.conditions + other.conditions)


def small_object_lark(schema: Any) -> str | None:
    """A Lark grammar for `schema` when every object it accepts has two keys at most; None otherwise."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return None
    try:
        clauses = _Reader(schema).clauses(schema, 0)
        if not clauses or any(c.high is None or c.high > _MAX_MEMBERS for c in clauses):
            return None
        return _Writer(schema).grammar(clauses)
    except Untranslatable:
        return None


class _Reader:
    def __init__(self, root: dict) -> None:
        self.root = root

    def clauses(self, node: Any, depth: int) -> list[_Clause]:
        """`node`'s constraints in disjunctive form."""
        if depth > _MAX_DEPTH:
            raise Untranslatable
        if node is True:
            return [_Clause()]
        if not isinstance(node, dict):
            raise Untranslatable
        result = [_Clause()]
        for key, value in node.items():
            if key not in VALIDATION_KEYWORDS or key in ("properties", "patternProperties"):
                continue  # annotations; the two maps are read with additionalProperties below
            result = _product(result, self._keyword(key, value, node, depth))
        if "additionalProperties" not in node:
            result = _product(result, [_Clause(conditions=self._member_conditions(node, None))])
        return result

    def _keyword(self, key: str, value: Any, node: dict, depth: int) -> list[_Clause]:
        if key == "type":
            if value != "object":
                raise Untranslatable
            return [_Clause()]
        if key in ("minProperties", "maxProperties"):
            if not isinstance(value, int) or isinstance(value, bool):
                raise Untranslatable
            return [_Clause(low=value)] if key == "minProperties" else [_Clause(high=value)]
        if key == "required":
            if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
                raise Untranslatable
            return [_Clause(exists=[({"const": k}, True) for k in value])]
        if key == "propertyNames":
            return [_Clause(keys=[value])]
        if key == "additionalProperties":
            return [_Clause(conditions=self._member_conditions(node, value))]
        if key == "$ref":
            target = resolve_ref(value, self.root)
            if target is None:
                raise Untranslatable
            return self.clauses(target, depth + 1)
        if key == "allOf" and isinstance(value, list):
            result = [_Clause()]
            for member in value:
                result = _product(result, self.clauses(member, depth + 1))
            return result
        if key == "anyOf" and isinstance(value, list):
            result = [c for member in value for c in self.clauses(member, depth + 1)]
            if len(result) > _MAX_CLAUSES:
                raise Untranslatable
            return result
        if key == "not" and isinstance(value, dict):
            return [self._some_member(value)]
        raise Untranslatable

    def _member_conditions(self, node: dict, extra: Any) -> list[tuple[Any, Any, int, bool]]:
        properties = node.get("properties") or {}
        patterns = node.get("patternProperties") or {}
        if not isinstance(properties, dict) or not isinstance(patterns, dict):
            raise Untranslatable
        group = id(node)
        conditions = [({"const": name}, sub, group, False) for name, sub in properties.items()]
        conditions += [({"pattern": pattern}, sub, group, False) for pattern, sub in patterns.items()]
        if extra is not None:
            named = [{"const": name} for name in properties] + [{"pattern": p} for p in patterns]
            conditions.append(({"not": {"anyOf": named}} if named else True, extra, group, True))
        return [c for c in conditions if c[1] is not True and c[1] != {}]

    def _some_member(self, negated: dict) -> _Clause:
        """The complement of a constraint on every member: some member (key, value) breaks it."""
        if set(negated) == {"patternProperties"} and isinstance(negated["patternProperties"], dict) and len(
                negated["patternProperties"]) == 1:
            (pattern, sub), = negated["patternProperties"].items()
            value = negate(sub, self.root)
            if value is None:
                raise Untranslatable
            return _Clause(exists=[({"pattern": pattern}, value)])
        if set(negated) == {"propertyNames"}:
            return _Clause(exists=[({"not": negated["propertyNames"]}, True)])
        raise Untranslatable


def _product(left: list[_Clause], right: list[_Clause]) -> list[_Clause]:
    if len(left) * len(right) > _MAX_CLAUSES:
        raise Untranslatable
    return [a.merged(b) for a, b in product(left, right)]


class _Writer:
    def __init__(self, root: dict) -> None:
        self.root = root
        self.terms = StringTerms(root)
        self.rules: list[str] = []
        self.objects: list[str] = []

    def grammar(self, clauses: list[_Clause]) -> str | None:
        for clause in clauses:
            self._clause(clause)
        if not self.objects:
            return None
        lines = [f"start: {' | '.join(dict.fromkeys(self.objects))}", *self.rules, *self.terms.rules()]
        return "\n".join(lines) + "\n"

    def _clause(self, clause: _Clause) -> None:
        if len(clause.exists) > _MAX_EXISTS or len(clause.conditions) > _MAX_CONDITIONS:
            raise Untranslatable
        high = min(clause.high if clause.high is not None else _MAX_MEMBERS, _MAX_MEMBERS)
        if clause.low <= 0 and not clause.exists:
            self.objects.append('"{}"')
        if clause.low <= 1 <= high:
            member = self._member(clause, clause.exists)
            if member is not None:
                self.objects.append(f'"{{" {member} "}}"')
        if clause.low <= 2 <= high:
            members: dict[tuple[int, ...], str | None] = {}
            for owners in product((0, 1), repeat=len(clause.exists)):
                picks = [tuple(i for i, o in enumerate(owners) if o == side) for side in (0, 1)]
                for pick in picks:
                    if pick not in members:
                        members[pick] = self._member(clause, [clause.exists[i] for i in pick])
                first, second = members[picks[0]], members[picks[1]]
                if first is not None and second is not None:
                    self.objects.append(f'"{{" {first} ", " {second} "}}"')

    def _member(self, clause: _Clause, exists: list[tuple[Any, Any]]) -> str | None:
        """A rule for one member meeting `exists` (and every condition on members); None when none can."""
        conditions = clause.conditions
        alternatives = []
        for inside in product((True, False), repeat=len(conditions)):
            if not _consistent(conditions, inside):
                continue
            values = [v for _, v in exists] + [c[1] for c, yes in zip(conditions, inside, strict=True) if yes]
            keys = clause.keys + [k for k, _ in exists] + [
                c[0] if yes else {"not": c[0]} for c, yes in zip(conditions, inside, strict=True)]
            value = {"allOf": values} if values else {}
            embedded = {**value, "x-guidance": _JSON_OPTIONS}
            if '"$ref"' in json.dumps(value):
                embedded.update(self._definitions())
            if any(v is False for v in values) or not _satisfiable(embedded):
                continue
            key = self.terms.term({"allOf": keys} if keys else True)
            if key is None:
                continue
            number = len(self.rules)
            self.rules.append(f'v{number}: K{number} ": " %json {json.dumps(embedded)}\nK{number}: "\\"" T{key} "\\""')
            alternatives.append(f"v{number}")
        if not alternatives:
            return None
        self.rules.append(f"m{len(self.rules)}: {' | '.join(alternatives)}")
        return f"m{len(self.rules) - 1}"

    def _definitions(self) -> dict:
        return {k: self.root[k] for k in ("definitions", "$defs") if isinstance(self.root.get(k), dict)}


def _consistent(conditions: list[tuple[Any, Any, int, bool]], inside: tuple[bool, ...]) -> bool:
    """Whether the region may hold a key: a node's additionalProperties covers none of the keys its other
    conditions do (nor, beside none, fails to cover any)."""
    for key, _, group, is_extra in conditions:
        if not is_extra:
            continue
        named_inside = any(yes for (_, _, g, e), yes in zip(conditions, inside, strict=True) if g == group and not e)
        extra_inside = next(yes for (k, _, g, e), yes in zip(conditions, inside, strict=True) if g == group and e)
        if (named_inside and extra_inside) or (key is True and not extra_inside):
            return False
    return True


def _satisfiable(value: dict) -> bool:
    """Whether some JSON value meets `value`; refusals other than an empty schema leave the whole object
    to the JSON compiler (a region dropped for any other reason would refuse valid objects)."""
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(value))
    if not error:
        return True
    if "Unsatisfiable" in error or "unsatisfiable" in error:
        return False
    raise Untranslatable
