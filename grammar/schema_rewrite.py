"""Rewrites of a JSON schema that keep its language exactly and that the backends can then enforce.

`oneOf` means "exactly one branch": a backend that only knows `anyOf` ("at
least one") would be looser. When every two branches are provably disjoint
(no instance can match both), the two are the same language, and `oneOf` is
rewritten as `anyOf`. The proof is conservative: distinct types, distinct
constants, or a required property whose constants differ; anything it cannot
prove stays `oneOf` (and a backend that cannot enforce it refuses it).
"""

from __future__ import annotations

import copy
import json
from itertools import combinations
from typing import Any

from loraplex.grammar.schema_walk import subschemas

_MAX_BRANCHES = 64
_MAX_REF_HOPS = 16


def with_disjoint_one_of_as_any_of(schema: Any) -> Any:
    """`schema` (a copy when anything changes) with each provably disjoint `oneOf` written as `anyOf`."""
    if not any(isinstance(node, dict) and "oneOf" in node for _, node, _ in subschemas(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, node, _ in list(subschemas(schema)):
        if not isinstance(node, dict) or "anyOf" in node or not isinstance(node.get("oneOf"), list):
            continue
        branches = [_resolve(b, schema) for b in node["oneOf"]]
        if len(branches) <= _MAX_BRANCHES and all(_disjoint(a, b, schema) for a, b in combinations(branches, 2)):
            node["anyOf"] = node.pop("oneOf")
    return schema


def _resolve(node: Any, root: Any) -> Any:
    for _ in range(_MAX_REF_HOPS):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            return node
        target: Any = root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        if target is None:
            return node
        if len(node) > 1:  # sibling keywords beside $ref: not a plain alias, prove nothing
            return {}
        node = target
    return {}


def _types(node: dict) -> set[str] | None:
    declared = node.get("type")
    if declared is None:
        if "const" in node:
            return {_type_of(node["const"])}
        if isinstance(node.get("enum"), list) and node["enum"]:
            return {_type_of(v) for v in node["enum"]}
        return None
    types = {declared} if isinstance(declared, str) else set(declared)
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
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _values(node: dict) -> set[str] | None:
    if "const" in node:
        return {json.dumps(node["const"], sort_keys=True)}
    if isinstance(node.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in node["enum"]}
    return None


def _disjoint(a: Any, b: Any, root: Any, depth: int = 0) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > 4:
        return False
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None and not values_a & values_b:
        return True
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    required_both = set(a.get("required") or []) & set(b.get("required") or [])
    for key in required_both:
        if key in props_a and key in props_b and _disjoint(_resolve(props_a[key], root), _resolve(props_b[key], root),
                                                           root, depth + 1):
            return True
    # One branch closes its properties and the other requires a property it does not allow.
    for closed, other in ((a, b), (b, a)):
        if closed.get("additionalProperties") is False and not closed.get("patternProperties"):
            allowed = set(closed.get("properties") or {})
            if any(key not in allowed for key in other.get("required") or []) and _types(closed) == {"object"}:
                return True
    return False
