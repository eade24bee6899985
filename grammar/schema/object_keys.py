"""Rewrites of a subschema's object keywords into ones the backends enforce, each keeping its language exactly.

- `dependencies` / `dependentRequired` / `dependentSchemas` for property `p`
  become `anyOf: [{p absent}, S]` (an object without `p` owes nothing);
- an object that requires a key it does not allow accepts nothing (`false`);
- `propertyNames` becomes the keys it allows: a finite set (`enum`/`const`)
  becomes those `properties` and no others; the complement of a finite set
  (`not: {enum}`) becomes `patternProperties` over the strings outside it and
  the declared keys; a `pattern` on an object without declared keys becomes
  `patternProperties: {pattern: additionalProperties}` (or on one whose other
  keys are free, the declared keys that do not match become `false`);
- `minProperties`/`maxProperties` of a closed object (`additionalProperties:
  false`, no `patternProperties`) become the `anyOf` of the sets of its
  declared keys whose sizes are within the bounds (each set: those keys
  required, the others absent);
- `minProperties: 1` beside optional `properties` becomes "one of them is
  required, or none is present and some other key is";
- beside a few optional keys of an open object, `minProperties` /
  `maxProperties` become one branch per set of them present, each keeping the
  counts.
Each returns the rewritten node, or None when its rewrite does not apply.
"""

from __future__ import annotations

import re
from itertools import combinations
from math import comb
from typing import Any

from loraplex.grammar.schema.connectives import all_of, any_of, conjoin
from loraplex.grammar.schema.negate import strings_outside

_MAX_DEPENDENCIES = 8
_MAX_KEY_SETS = 64   # branches of a min/maxProperties rewrite
_MAX_NAMES = 256     # keys of a finite propertyNames
_MAX_OPTIONAL_COUNTED = 4  # optional keys split on beside min/maxProperties (2**4 branches)


def at_least_one_property(node: dict, root: Any) -> Any | None:
    """`minProperties: 1` beside optional `properties`: one of them is present, or none is and another key is."""
    if node.get("minProperties") != 1 or not isinstance(node.get("properties"), dict) or all(
            sub is False for sub in node["properties"].values()):
        return None
    declared = list(node["properties"])
    branches: list[Any] = [{"required": [name]} for name in declared]
    if node.get("additionalProperties") is not False or node.get("patternProperties"):
        branches.append({"properties": dict.fromkeys(declared, False), "minProperties": 1})
    rest = {k: v for k, v in node.items() if k != "minProperties"}
    return conjoin(rest, any_of(branches))


_OBJECT_SHAPE = ("properties", "required", "patternProperties", "additionalProperties", "minProperties",
                 "maxProperties")


def property_count_by_presence(node: dict, root: Any) -> Any | None:
    """min/maxProperties beside optional `properties`: one branch per set of them present (those required,
    the others `false`), each keeping the counts; backends count keys once every listed key is required."""
    if "minProperties" not in node and "maxProperties" not in node:
        return None
    properties, required = node.get("properties", {}), node.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list):
        return None
    optional = [k for k, sub in properties.items() if sub is not False and k not in required]
    if not optional or len(optional) > _MAX_OPTIONAL_COUNTED:
        return None
    shape = {k: node[k] for k in _OBJECT_SHAPE if k in node}
    branches = []
    for n in range(len(optional) + 1):
        for chosen in combinations(optional, n):
            kept = {k: (False if k in optional and k not in chosen else sub) for k, sub in properties.items()}
            branches.append({**shape, "properties": kept, "required": [*required, *chosen]})
    rest = {k: v for k, v in node.items() if k not in _OBJECT_SHAPE}
    return conjoin(rest, any_of(branches))


def requires_forbidden_key(node: dict) -> bool:
    """An object-only schema requiring a key that its `properties`/`additionalProperties` forbid."""
    required = node.get("required")
    if node.get("type") != "object" or not isinstance(required, list) or not required:
        return False
    properties = node.get("properties")
    if not isinstance(properties, dict):
        properties = {}
    closed = node.get("additionalProperties") is False and not node.get("patternProperties")
    return any(isinstance(key, str) and (properties.get(key) is False or (closed and key not in properties))
               for key in required)


def closed_property_count(node: dict, root: Any) -> Any | None:
    """min/maxProperties of a closed object: the anyOf of its allowed key sets (sizes within the bounds)."""
    if ("minProperties" not in node and "maxProperties" not in node) or node.get("additionalProperties") is not False:
        return None
    properties = node.get("properties", {})
    low, high = node.get("minProperties", 0), node.get("maxProperties")
    if (node.get("patternProperties") or not isinstance(properties, dict) or not isinstance(low, int)
            or not (high is None or isinstance(high, int)) or isinstance(low, bool) or isinstance(high, bool)):
        return None
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        return None
    declared = [k for k, sub in properties.items() if sub is not False]
    if any(k not in declared for k in required):
        return False
    optional = [k for k in declared if k not in required]
    high = len(declared) if high is None else min(high, len(declared))
    sizes = range(max(low - len(required), 0), high - len(required) + 1)
    if high == len(declared) and sizes:
        sizes = sizes[:1]  # no upper bound: "these keys at least" for each smallest set, the others free
    if sum(comb(len(optional), n) for n in sizes) > _MAX_KEY_SETS:
        return None
    rest = {k: v for k, v in node.items() if k not in ("minProperties", "maxProperties")}
    branches: list[Any] = []
    for n in sizes:
        for chosen in combinations(optional, n):
            absent = {} if high == len(declared) else {k: False for k in optional if k not in chosen}
            branch: dict[str, Any] = {"required": [k for k in declared if k in chosen or k in required]}
            if absent:
                branch["properties"] = absent
            branches.append(branch)
    if not branches:
        return False
    return conjoin(rest, any_of(branches))


def property_names(node: dict, root: Any) -> Any | None:
    """`propertyNames` written as the keys it allows (see the module's docstring); None when it cannot be."""
    if "propertyNames" not in node:
        return None
    names = node["propertyNames"]
    rest = {k: v for k, v in node.items() if k != "propertyNames"}
    if names is True or names == {}:
        return rest
    properties = node.get("properties", {})
    if not isinstance(properties, dict) or node.get("patternProperties"):
        return None
    if names is False:  # no key at all
        return {**rest, "properties": {k: False for k in properties}, "additionalProperties": False}
    if not isinstance(names, dict):
        return None
    extra = node.get("additionalProperties", True)
    allowed = _finite_strings(names)
    if allowed is not None:
        kept = {k: properties.get(k, extra) for k in allowed}
        return {**rest, "properties": kept, "additionalProperties": False}
    if set(names) == {"not"} and isinstance(names["not"], dict):
        excluded = _finite_strings(names["not"])
        if excluded is None:
            return None
        kept = {k: (False if k in excluded else sub) for k, sub in properties.items()}
        out = {**rest, "properties": kept, "additionalProperties": False}
        if extra is not False:
            out["patternProperties"] = {strings_outside(sorted({*excluded, *properties})): extra}
        return out
    if set(names) - {"type"} == {"pattern"} and names.get("type", "string") == "string" and isinstance(
            names["pattern"], str):
        pattern = names["pattern"]
        if not properties:
            if extra is False:
                return rest
            return {**rest, "patternProperties": {pattern: extra}, "additionalProperties": False}
        if extra is True or extra == {}:
            try:
                compiled = re.compile(pattern)
            except re.error:
                return None
            if not all(k.isascii() for k in properties) or not pattern.isascii():
                return None  # where Python's regex and ECMA-262 may differ (Unicode classes)
            kept = {k: (sub if compiled.search(k) else False) for k, sub in properties.items()}
            return {**rest, "properties": kept, "patternProperties": {pattern: {}}, "additionalProperties": False}
    return None


def _finite_strings(schema: dict) -> list[str] | None:
    """The strings of an `enum`/`const`-only schema (other types dropped: keys are strings)."""
    if set(schema) - {"type"} == {"const"} and schema.get("type", "string") == "string":
        values = [schema["const"]]
    elif set(schema) - {"type"} == {"enum"} and schema.get("type", "string") == "string" and isinstance(
            schema["enum"], list):
        values = schema["enum"]
    else:
        return None
    strings = list(dict.fromkeys(v for v in values if isinstance(v, str)))
    return strings if len(strings) <= _MAX_NAMES else None


def dependencies(node: dict, root: Any) -> Any | None:
    """`dependencies`, `dependentRequired` or `dependentSchemas` as an anyOf per property (the first that can be)."""
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        if isinstance(node.get(key), dict):
            rewritten = _dependencies_of(node, key)
            if rewritten is not None:
                return rewritten
    return None


def forbidden_required_key(node: dict, root: Any) -> Any | None:
    """An object-only schema requiring a key that it forbids accepts nothing."""
    return False if requires_forbidden_key(node) else None


def _dependencies_of(node: dict, key: str) -> Any | None:
    entries = node[key]
    if len(entries) > _MAX_DEPENDENCIES:
        return None
    clauses = []
    for name, dependency in entries.items():
        if isinstance(dependency, list):
            if not dependency:
                continue
            dependency = {"required": dependency}
        elif dependency is True or dependency == {}:
            continue
        elif not isinstance(dependency, dict | bool):
            return None
        clauses.append(any_of([{"properties": {name: False}}, dependency]))
    rest = {k: v for k, v in node.items() if k != key}
    return conjoin(rest, all_of(clauses))


