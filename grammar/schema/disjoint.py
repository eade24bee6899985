"""Proofs that two subschemas share no instance, for rewriting `oneOf` as `anyOf`.

Conservative: `disjoint` answers True only with a proof, over the conjuncts of
each side (the schema, its `allOf` members and `$ref` targets, which an
instance of it matches all of):
- the types they allow do not meet;
- their constants differ, or no value of one side's finite set (`enum`/`const`)
  is valid against the other side (`jsonschema` says, under every draft the
  root may mean);
- both are objects there and a key that one requires has disjoint schemas on
  the two sides, or one side is closed and the other requires a key it does
  not allow, or one side needs more keys than the other allows (`required`
  and `minProperties`, through `anyOf`/`oneOf` branches, against
  `maxProperties` or a closed object's declared keys);
- one side is a string matching an anchored pattern over an alphabet (each
  character of a match comes from it), and the other side's pattern needs a
  character outside that alphabet in every match.
Branches that constrain objects only all accept every other value: with two
of them or more, a `oneOf` over them holds only for objects, so disjoint among
objects is enough there (and the rewrite adds `type: object`). A `oneOf`
only decides among instances that also match the keywords beside it, so those
join both sides of the proof (`context`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from loraplex.grammar.schema.finite import JUDGING_ERRORS, offline_validators
from loraplex.grammar.schema.walk import VALIDATION_KEYWORDS, conjuncts

try:
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants
    import sre_parse

_OBJECT_ONLY = frozenset({
    "properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties",
    "propertyNames", "dependencies", "dependentRequired", "dependentSchemas", "$ref", "allOf",
})
_MAX_DEPTH = 4
_MAX_VALUES = 64
_NON_ASCII = (128, 0x10FFFF)
_CLASSES = {  # ASCII in ECMA-262 (no `u` flag), any Unicode digit or letter in Python's `re`: both kept
    sre_constants.CATEGORY_DIGIT: [(48, 57), _NON_ASCII],
    sre_constants.CATEGORY_WORD: [(48, 57), (65, 90), (95, 95), (97, 122), _NON_ASCII],
}


class Disjointness:
    """Proofs over the subschemas of one root (its `$ref`s resolved, its draft respected)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._validators: list[Any] | None = None

    def disjoint(self, a: Any, b: Any, depth: int = 0, *, among_objects: bool = False, context: Any = True) -> bool:
        """No instance matches both (`among_objects`: no object does; `context`: no instance of it does)."""
        if depth > _MAX_DEPTH:
            return False
        parts_a, parts_b, shared = self._conjuncts(a), self._conjuncts(b), self._conjuncts(context)
        if parts_a is None or parts_b is None:
            return False
        if shared:  # what every instance in question also matches narrows both sides
            parts_a, parts_b = [*parts_a, *shared], [*parts_b, *shared]
        types_a, types_b = _allowed_types(parts_a), _allowed_types(parts_b)
        if among_objects:
            types_a = {"object"} if types_a is None else types_a & {"object"}
            types_b = {"object"} if types_b is None else types_b & {"object"}
        if types_a is not None and types_b is not None and not types_a & types_b:
            return True
        for x in parts_a:
            for y in parts_b:
                values_x, values_y = _values(x), _values(y)
                if values_x is not None and values_y is not None and not values_x & values_y:
                    return True
        if self._finite_outside(parts_a, b) or self._finite_outside(parts_b, a):
            return True
        objects = any(t is not None and t <= {"object"} for t in (types_a, types_b))
        if objects and (self._keys_disjoint(parts_a, parts_b, depth) or self._counts_disjoint(parts_a, parts_b)):
            return True
        return (_strings_outside_alphabet(parts_a, types_a, parts_b)
                or _strings_outside_alphabet(parts_b, types_b, parts_a))

    def object_only(self, node: Any) -> bool:
        """Whether `node` constrains objects only (every other value matches it)."""
        parts = self._conjuncts(node)
        return parts is not None and all(set(part) & VALIDATION_KEYWORDS <= _OBJECT_ONLY for part in parts)

    def _conjuncts(self, node: Any) -> list[dict] | None:
        return conjuncts(node, self.root)

    def _keys_disjoint(self, parts_a: list[dict], parts_b: list[dict], depth: int) -> bool:
        required = {k for part in (*parts_a, *parts_b) for k in part.get("required") or [] if isinstance(k, str)}
        for key in required:  # every instance of both is an object holding `key`
            for x in parts_a:
                for y in parts_b:
                    px, py = x.get("properties"), y.get("properties")
                    if (isinstance(px, dict) and isinstance(py, dict) and key in px and key in py
                            and self.disjoint(px[key], py[key], depth + 1)):
                        return True
        for closed_parts, other_parts in ((parts_a, parts_b), (parts_b, parts_a)):
            other_required = {k for part in other_parts for k in part.get("required") or [] if isinstance(k, str)}
            for part in closed_parts:
                if part.get("additionalProperties") is False and not part.get("patternProperties"):
                    allowed = {k for k, sub in (part.get("properties") or {}).items() if sub is not False}
                    if other_required - allowed:
                        return True
        return False

    def _counts_disjoint(self, parts_a: list[dict], parts_b: list[dict]) -> bool:
        """Every object of one side has more keys than any object of the other may."""
        for low_parts, high_parts in ((parts_a, parts_b), (parts_b, parts_a)):
            high = _most_keys(high_parts)
            if high is not None and self._fewest_keys(low_parts, 0) > high:
                return True
        return False

    def _fewest_keys(self, parts: list[dict], depth: int) -> int:
        """A lower bound on the keys of an object matching every part (0 when nothing says more)."""
        required = {k for part in parts for k in part.get("required") or [] if isinstance(k, str)}
        fewest = len(required)
        for part in parts:
            low = part.get("minProperties")
            if isinstance(low, int) and not isinstance(low, bool):
                fewest = max(fewest, low)
            for key in ("anyOf", "oneOf"):  # some branch holds: the object has at least its branches' least
                branches = part.get(key)
                if depth < _MAX_DEPTH and isinstance(branches, list) and branches:
                    each = [self._conjuncts(branch) for branch in branches]
                    fewest = max(fewest, min(self._fewest_keys(b, depth + 1) if b is not None else 0 for b in each))
        return fewest

    def _finite_outside(self, parts: list[dict], other: Any) -> bool:
        """Some part of one side is a finite set of values, none of them valid against `other`."""
        for part in parts:
            values = [part["const"]] if "const" in part else part.get("enum")
            if not isinstance(values, list) or not values or len(values) > _MAX_VALUES:
                continue
            validators = self._get_validators()
            if not validators:
                return False
            try:
                checks = [v.evolve(schema=other) for v in validators]
                if not any(check.is_valid(value) for check in checks for value in values):
                    return True
            except JUDGING_ERRORS:
                return False
        return False

    def _get_validators(self) -> list[Any]:
        if self._validators is None:
            self._validators = offline_validators(self.root)
        return self._validators


def _most_keys(parts: list[dict]) -> int | None:
    """An upper bound on the keys of an object matching every part; None when nothing bounds them."""
    bounds = []
    for part in parts:
        high = part.get("maxProperties")
        if isinstance(high, int) and not isinstance(high, bool):
            bounds.append(high)
        if part.get("additionalProperties") is False and not part.get("patternProperties"):
            bounds.append(sum(1 for sub in (part.get("properties") or {}).values() if sub is not False))
    return min(bounds) if bounds else None


def _allowed_types(parts: list[dict]) -> set[str] | None:
    """The types an instance matching every part may have; None when no part says."""
    allowed: set[str] | None = None
    for part in parts:
        types = _types(part)
        if types is not None:
            allowed = types if allowed is None else allowed & types
    return allowed


def _types(node: dict) -> set[str] | None:
    declared = node.get("type")
    if declared is None:
        if "const" in node:
            return {_type_of(node["const"])}
        if isinstance(node.get("enum"), list) and node["enum"]:
            return {_type_of(v) for v in node["enum"]}
        return None
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else None
    if types is None:
        return None
    if "number" in types:
        types.add("integer")
    return types


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names[type(value)]


def _values(node: dict) -> set[str] | None:
    if "const" in node:
        return {json.dumps(node["const"], sort_keys=True)}
    if isinstance(node.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in node["enum"]}
    return None


def _strings_outside_alphabet(pinned: list[dict], types: set[str] | None, other: list[dict]) -> bool:
    if types is None or not types <= {"string"}:
        return False
    alphabets = [a for part in pinned if isinstance(part.get("pattern"), str)
                 if (a := _anchored_alphabet(part["pattern"])) is not None]
    needed = {c for part in other if isinstance(part.get("pattern"), str) for c in _needed_chars(part["pattern"])}
    return any(not any(lo <= c <= hi for lo, hi in alphabet) for alphabet in alphabets for c in needed)


def _parse(pattern: str) -> list | None:
    try:
        return list(sre_parse.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return None


def _anchored_alphabet(pattern: str) -> list[tuple[int, int]] | None:
    """The code-point ranges every character of a match of `^...$` comes from; None when not that simple."""
    items = _parse(pattern)
    if (not items or len(items) < 2 or items[0] != (sre_constants.AT, sre_constants.AT_BEGINNING)
            or items[-1] != (sre_constants.AT, sre_constants.AT_END)):
        return None
    alphabet = _alphabet(items[1:-1])
    # Python's `$` also matches before a final newline: the alphabet holds it too, for either reading.
    return None if alphabet is None else [*alphabet, (10, 10)]


def _alphabet(items: list) -> list[tuple[int, int]] | None:
    ranges: list[tuple[int, int]] = []
    for op, arg in items:
        if op == sre_constants.LITERAL:
            ranges.append((arg, arg))
        elif op == sre_constants.IN:
            for inner_op, inner in arg:
                if inner_op == sre_constants.LITERAL:
                    ranges.append((inner, inner))
                elif inner_op == sre_constants.RANGE:
                    ranges.append(inner)
                elif inner_op == sre_constants.CATEGORY and inner in _CLASSES:
                    ranges += _CLASSES[inner]
                else:
                    return None  # a negated set, \s, ...: no small alphabet
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
            inner_ranges = _alphabet(list(arg[2]))
            if inner_ranges is None:
                return None
            ranges += inner_ranges
        elif op == sre_constants.SUBPATTERN and not arg[1] and not arg[2]:
            inner_ranges = _alphabet(list(arg[3]))
            if inner_ranges is None:
                return None
            ranges += inner_ranges
        elif op == sre_constants.BRANCH:
            for branch in arg[1]:
                inner_ranges = _alphabet(list(branch))
                if inner_ranges is None:
                    return None
                ranges += inner_ranges
        else:
            return None  # `.`, anchors inside, lookarounds, back-references
    return ranges


def _needed_chars(pattern: str) -> set[int]:
    """Characters every match of `pattern` (searched anywhere in the string) contains."""
    items = _parse(pattern)
    return _needed(items) if items is not None else set()


def _needed(items: list) -> set[int]:
    needed: set[int] = set()
    for op, arg in items:
        if op == sre_constants.LITERAL:
            needed.add(arg)
        elif op == sre_constants.IN and len(arg) == 1 and arg[0][0] == sre_constants.LITERAL:
            needed.add(arg[0][1])
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and arg[0] >= 1:
            needed |= _needed(list(arg[2]))
        elif op == sre_constants.SUBPATTERN and not arg[1] and not arg[2]:
            needed |= _needed(list(arg[3]))
    return needed
