"""Proofs that one subschema accepts nothing another rejects (`a` is a subset of `b`).

Conservative: `subset` answers True only with a proof. Every validation
keyword of `b` must be implied by some conjunct of `a` (`a` itself, its
`allOf` members and `$ref` targets): the same value, a narrower `type`, a
superset of `required`, or `properties`/`items` whose subschemas are
subsets in turn; `b`'s `allOf` and `$ref` must each hold, and one `anyOf`
branch of `b` holding is enough. It lets `if`/`then` be rewritten without a
complement: when `if` implies `then`, `if I then T else E` is `I or E`.
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.grammar.schema.walk import VALIDATION_KEYWORDS, conjuncts, resolve_ref

_MAX_DEPTH = 8
_CONDITIONAL = ("if", "then", "else")
_CONTAINS = ("contains", "minContains", "maxContains")
_SIBLING_BOUND = {
    **dict.fromkeys(_CONDITIONAL, _CONDITIONAL), **dict.fromkeys(_CONTAINS, _CONTAINS),
    # what counts as evaluated depends on every applicator beside them
    "unevaluatedProperties": tuple(VALIDATION_KEYWORDS), "unevaluatedItems": tuple(VALIDATION_KEYWORDS),
}


def subset(a: Any, b: Any, root: Any, depth: int = 0) -> bool:
    """Whether every instance `a` accepts, `b` accepts (False when that is not proven)."""
    if b is True or (isinstance(b, dict) and not set(b) & VALIDATION_KEYWORDS) or a is False:
        return True
    if depth > _MAX_DEPTH or not isinstance(b, dict):
        return False
    parts = conjuncts(a, root)
    if parts is None:
        return False
    for key in set(b) & VALIDATION_KEYWORDS:
        value = b[key]
        if key == "$ref":
            target = resolve_ref(value, root)
            if target is None or not subset(a, target, root, depth + 1):
                return False
        elif key == "allOf":
            if not isinstance(value, list) or not all(subset(a, m, root, depth + 1) for m in value):
                return False
        elif key == "anyOf":
            if not isinstance(value, list) or not any(subset(a, m, root, depth + 1) for m in value):
                return False
        elif not any(_implies(part, key, value, b, root, depth) for part in parts):
            return False
    return True


def _implies(part: dict, key: str, value: Any, b: dict, root: Any, depth: int) -> bool:
    """Whether `part` alone guarantees `b`'s `key: value`."""
    if key in _SIBLING_BOUND:  # these mean something only together with their siblings: all must agree
        return all(_same(part.get(k), b.get(k)) for k in _SIBLING_BOUND[key])
    if key in part and _same(part[key], value) and (key not in ("items", "additionalItems", "additionalProperties")
                                                    or _same_siblings(part, b, key)):
        return True
    if key == "type":
        wider = _types(value)
        if wider is None:
            return False
        values = [part["const"]] if "const" in part else part.get("enum")
        if isinstance(values, list):
            return all(_type_of(v) in wider for v in values)
        narrower = _types(part.get("type"))
        return narrower is not None and narrower <= wider
    if key == "required":
        return isinstance(value, list) and isinstance(part.get("required"), list) and set(value) <= set(
            part["required"])
    if key == "properties" and isinstance(value, dict) and isinstance(part.get("properties"), dict):
        return all(name in part["properties"] and subset(part["properties"][name], sub, root, depth + 1)
                   for name, sub in value.items())
    if key == "items" and isinstance(value, dict | bool) and isinstance(part.get("items"), dict | bool):
        return _same_siblings(part, b, key) and subset(part["items"], value, root, depth + 1)
    return False


def _same_siblings(part: dict, b: dict, key: str) -> bool:
    """`items`/`additional*` mean the same on both sides only beside the same keywords they depend on."""
    siblings = {"items": ("prefixItems",), "additionalItems": ("items",),
                "additionalProperties": ("properties", "patternProperties")}[key]
    return all(_same(part.get(s), b.get(s)) for s in siblings)


def _types(declared: Any) -> set[str] | None:
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else None
    if types is not None and "number" in types:
        types.add("integer")
    return types


def _same(x: Any, y: Any) -> bool:
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


def _type_of(value: Any) -> str:
    """The narrowest JSON Schema type of a value (1.0 is an integer)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(value), "object")
