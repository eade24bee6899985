"""An object schema as an llguidance Lark grammar: each key one terminal, each value an embedded JSON schema.

"Some key matches P and its value V" (`not` of a `patternProperties`, or of a
`propertyNames`; `required`) is a constraint on one of the members there
are. With `maxProperties` 1 or 2, each such constraint is given to a member
(every way of giving them is an alternative), whose key then lies in the
constraint's set and whose value meets its V. With more members allowed (or
no bound), the members are read one after another, the grammar's state being
how many were read (counted as far as a bound needs) and which constraints
no member has met yet: a member may meet any of those, and `}` comes only
once none is left. llguidance's JSON compiler has
no complement and wants `patternProperties` disjoint; a Lark grammar can say
it: a key is a string terminal (`&`, `~`, as in `string_lark`), a value
`%json{...}`. Every "each key matching C has a value in V" (`properties`,
`patternProperties`, `additionalProperties`) splits the key space in regions
(in C or not), each with the values it owes; conditions on the same keys
(an `allOf` repeating a pattern) are one, owing every value. A value the
JSON compiler refuses (an object below the root that must hold some key
matching P) is written the same way, as rules of its own beside the root's,
its other types as JSON where they meet it; a value that recurs through
`$ref` names its rule again. `anyOf` over such conditions is
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
from loraplex.grammar.backends.clause_algebra import clause_product, connective_clauses
from loraplex.grammar.backends.counted_lark import counted_rules, num_states
from loraplex.grammar.backends.string_lark import StringTerms, Untranslatable
from loraplex.grammar.schema.connectives import all_of
from loraplex.grammar.schema.finite import JUDGING_ERRORS, offline_validators
from loraplex.grammar.schema.negate import negate
from loraplex.grammar.schema.walk import VALIDATION_KEYWORDS, conjuncts

_MAX_CLAUSES = 32
_MAX_CONDITIONS = 5   # regions: 2 ** conditions per member
_MAX_MEMBERS = 2
_MAX_EXISTS = 6       # ways of giving them to two members: 2 ** constraints
_MAX_STATES = 512     # (members read, constraints left) of a larger object: one rule each
_MAX_DEPTH = 16
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_NESTED = 16      # objects written as rules of their own, inside the values of others
_NOT_OBJECT = ["array", "boolean", "null", "number", "string"]

# (key schema, value schema owed there, the nodes it comes from, whether it is those nodes'
# additionalProperties: its keys are none of the nodes' other conditions)
_Condition = tuple[Any, Any, frozenset[int], bool]


@dataclass(slots=True)
class _Clause:
    """One conjunction of constraints on an object of at most two members."""

    low: int = 0
    high: int | None = None
    keys: list[Any] = field(default_factory=list)         # string schemas every key meets
    exists: list[tuple[Any, Any]] = field(default_factory=list)  # (key schema, value schema) some member meets
    conditions: list[_Condition] = field(default_factory=list)

    def merged(self, other: _Clause) -> _Clause:
        highs = [h for h in (self.high, other.high) if h is not None]
        return _Clause(max(self.low, other.low), min(highs) if highs else None, self.keys + other.keys,
                       self.exists + other.exists, _merged_conditions(self.conditions + other.conditions))


def _merged_conditions(conditions: list[_Condition]) -> list[_Condition]:
    """Conditions on the same keys as one, owing every value they owe and standing for every node they come
    from: `allOf` members often repeat a pattern (a region per copy would double the regions for nothing).
    An additionalProperties condition stays apart (its keys depend on its node's other conditions)."""
    merged: dict[str, _Condition] = {}
    for key, value, groups, is_extra in conditions:
        text = json.dumps([key, value] if is_extra else key, sort_keys=True) + str(is_extra)
        known = merged.get(text)
        if known is not None and known[1] != value:
            value = all_of([known[1], value])
        merged[text] = (key, value, groups | known[2] if known else groups, is_extra)
    return list(merged.values())


def object_lark(schema: Any) -> str | None:
    """A Lark grammar for an object schema made of the keywords above; None otherwise."""
    parts = conjuncts(schema, schema) if isinstance(schema, dict) else None
    if not parts or not any(part.get("type") == "object" for part in parts):  # objects only, through $ref too
        return None
    try:
        clauses = _Reader(schema).clauses(schema, 0)
        if not clauses:
            return None
        return _Writer(schema).grammar(clauses)
    except Untranslatable:
        return None


class _Reader:
    def __init__(self, root: dict[str, Any]) -> None:
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
            result = clause_product(result, self._keyword(key, value, node, depth), _MAX_CLAUSES)
        if "additionalProperties" not in node:
            result = clause_product(result, [_Clause(conditions=self._member_conditions(node, None))], _MAX_CLAUSES)
        return result

    def _keyword(self, key: str, value: Any, node: dict[str, Any], depth: int) -> list[_Clause]:
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
        if key == "not" and isinstance(value, dict):
            return [self._some_member(value)]
        combined = connective_clauses(key, value, root=self.root, new=_Clause, most=_MAX_CLAUSES,
                                      read=lambda member: self.clauses(member, depth + 1))
        if combined is None:
            raise Untranslatable
        return combined

    def _member_conditions(self, node: dict[str, Any], extra: Any) -> list[_Condition]:
        properties = node.get("properties") or {}
        patterns = node.get("patternProperties") or {}
        if not isinstance(properties, dict) or not isinstance(patterns, dict):
            raise Untranslatable
        group = frozenset({id(node)})
        conditions: list[_Condition] = [({"const": name}, sub, group, False)
                                                         for name, sub in properties.items()]
        conditions += [({"pattern": pattern}, sub, group, False) for pattern, sub in patterns.items()]
        if extra is not None:
            named = [{"const": name} for name in properties] + [{"pattern": p} for p in patterns]
            conditions.append(({"not": {"anyOf": named}} if named else True, extra, group, True))
        return [c for c in conditions if c[1] is not True and c[1] != {}]

    def _some_member(self, negated: dict[str, Any]) -> _Clause:
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


class _Writer:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.terms = StringTerms(root)
        self.rules: list[str] = []
        self.objects: list[str] = []
        self.nested: dict[str, str] = {}  # a value's schema (JSON) -> the rule of its values
        self.keys: dict[str, int | None] = {}  # a key schema (JSON) -> its terminal

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
        if clause.high is None or clause.high > _MAX_MEMBERS:
            self._counted(clause)
            return
        high = clause.high
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

    def _counted(self, clause: _Clause) -> None:
        """Members one after another. A state is (members read, the bit set of constraints still unmet); with
        no upper bound the count stops at `low` (or 1: any more are alike). Rule `r{n}_{read}_{left}` is what may
        follow in that state: `}` once enough were read and none is left, or `, ` and one more member."""
        exists, low, high = clause.exists, max(clause.low, 0), clause.high
        if num_states(low, high, len(exists)) > _MAX_STATES:
            raise Untranslatable
        members: dict[int, str | None] = {}
        for met in range(1 << len(exists)):  # a member meeting (at least) the constraints in `met`
            members[met] = self._member(clause, [e for i, e in enumerate(exists) if met >> i & 1])
        rules, openings = counted_rules(members, low, high, prefix=f"r{len(self.rules)}", brackets=("{", "}"),
                                        only_unmet=True)
        self.rules += rules
        self.objects += openings

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
            value = self._value(values)
            if value is None:
                continue
            key = self._key({"allOf": keys} if keys else True)
            if key is None:
                continue
            number = len(self.rules)
            self.rules.append(f'v{number}: K{number} ": " {value}\nK{number}: "\\"" T{key} "\\""')
            alternatives.append(f"v{number}")
        if not alternatives:
            return None
        self.rules.append(f"m{len(self.rules)}: {' | '.join(alternatives)}")
        return f"m{len(self.rules) - 1}"

    def _key(self, schema: Any) -> int | None:
        """The terminal of the keys `schema` allows, written once however many members and objects use it."""
        text = json.dumps(schema, sort_keys=True)
        if text not in self.keys:
            self.keys[text] = self.terms.term(schema)
        return self.keys[text]

    def _value(self, values: list[Any]) -> str | None:
        """The value a member owes, in Lark: embedded JSON where llguidance's JSON compiler takes it, else an
        object written as rules of its own (`_nested`); None when no value meets it."""
        if any(v is False for v in values):
            return None
        members = _flat_members(values)
        value = {"allOf": members} if members else {}
        embedded = {**value, "x-guidance": _JSON_OPTIONS}
        if '"$ref"' in json.dumps(value):
            embedded.update(self._definitions())
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(embedded))
        if not error:
            return f"%json {json.dumps(embedded)}"
        if "Unsatisfiable" in error or "unsatisfiable" in error:
            return None
        return self._nested(value)

    def _nested(self, value: dict[str, Any]) -> str:
        """A rule for the values of a schema whose objects only these grammars say (a member that must have
        a key matching P, below the root): its objects as members, its other types as JSON. The rule is
        named before it is written, so a value that recurs (through `$ref`) names it again."""
        text = json.dumps(value, sort_keys=True)
        if text in self.nested:
            return self.nested[text]
        if len(self.nested) >= _MAX_NESTED:
            raise Untranslatable
        name = self.nested[text] = f"o{len(self.nested)}"
        outer, self.objects = self.objects, []
        try:
            for clause in _Reader(self.root).clauses(value, 0):
                self._clause(clause)
            alternatives = list(dict.fromkeys(self.objects))
        finally:
            self.objects = outer
        if self._passes_non_objects(value):
            alternatives.append(f"%json {json.dumps({'type': _NOT_OBJECT, 'x-guidance': _JSON_OPTIONS})}")
        if not alternatives:
            raise Untranslatable
        self.rules.append(f"{name}: {' | '.join(alternatives)}")
        return name

    def _passes_non_objects(self, value: dict[str, Any]) -> bool:
        """Whether a value that is no object meets `value` (read as members, so every other type fares alike:
        object keywords pass it, a `not` of them fails it); jsonschema judges `null`, under each draft the
        root may mean."""
        if any(part.get("type") == "object" for part in conjuncts(value, self.root) or []):
            return False
        validators = offline_validators(self.root)
        try:
            return bool(validators) and all(v.evolve(schema=value).is_valid(None) for v in validators)
        except JUDGING_ERRORS:
            return False

    def _definitions(self) -> dict[str, Any]:
        return {k: self.root[k] for k in ("definitions", "$defs") if isinstance(self.root.get(k), dict)}


def _flat_members(values: list[Any]) -> list[Any]:
    """The members of `allOf: values`, nested bare allOfs flattened, `true` dropped, each once, in one order:
    the same value always reads the same (and names the same nested rule)."""
    members: dict[str, Any] = {}
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, dict) and set(value) == {"allOf"} and isinstance(value["allOf"], list):
            stack += value["allOf"]
        elif value is not True and value != {}:
            members[json.dumps(value, sort_keys=True)] = value
    return [members[k] for k in sorted(members)]


def _consistent(conditions: list[_Condition], inside: tuple[bool, ...]) -> bool:
    """Whether the region may hold a key: a node's additionalProperties covers none of the keys its other
    conditions do (nor, beside none, fails to cover any)."""
    for key, _, groups, is_extra in conditions:
        if not is_extra:
            continue
        named_inside = any(yes for (_, _, g, e), yes in zip(conditions, inside, strict=True) if g & groups and not e)
        extra_inside = next(yes for (k, _, g, e), yes in zip(conditions, inside, strict=True) if g & groups and e)
        if (named_inside and extra_inside) or (key is True and not extra_inside):
            return False
    return True
