"""Rewrites a JSON schema into keywords the backends enforce, keeping its language exactly.

Each rewrite is an identity of JSON Schema:
- a subschema drawn from a finite set becomes the `enum` of the values that
  validate (`schema_finite`);
- `not: S` becomes the complement of S (`schema_negate`), when it can be written;
- `if: I, then: T, else: E` becomes `anyOf: [allOf [I, T], allOf [not I, E]]`,
  or `anyOf: [I, E]` when I is provably a subset of T (`schema_subset`);
- `dependencies` / `dependentRequired` / `dependentSchemas` for property `p`
  become `anyOf: [{p absent}, S]` (an object without `p` owes nothing);
- `oneOf: [B1..Bn]` whose branches may overlap becomes
  `anyOf: [B1 and not B2 .. and not Bn, ...]`;
- `minProperties: 1` beside optional `properties` becomes "one of them is
  required, or none is present and some other key is";
- `minProperties`/`maxProperties` of a closed object (`additionalProperties:
  false`, no `patternProperties`) become the `anyOf` of the sets of its
  declared keys whose sizes are within the bounds (each set: those keys
  required, the others absent); beside a few optional keys of an open
  object, one branch per set of them present, each keeping the counts;
- `propertyNames` becomes the keys it allows: a finite set (`enum`/`const`)
  becomes those `properties` and no others; the complement of a finite set
  (`not: {enum}`) becomes `patternProperties` over the strings outside it and
  the declared keys; a `pattern` on an object without declared keys becomes
  `patternProperties: {pattern: additionalProperties}` (or on one whose other
  keys are free, the declared keys that do not match become `false`);
- an object that requires a key it does not allow accepts nothing (`false`).
A rewrite whose complement cannot be written is not made: the keyword stays,
and a backend that cannot enforce it refuses it. Sizes are capped (branches,
dependencies), so a rewrite never multiplies a schema beyond the compile
limits.
"""

from __future__ import annotations

import copy
import json
import re
from itertools import combinations
from math import comb
from typing import Any

from loraplex.grammar.schema_finite import FiniteValues
from loraplex.grammar.schema_negate import negate, strings_outside
from loraplex.grammar.schema_subset import subset
from loraplex.grammar.schema_walk import (
    VALIDATION_KEYWORDS,
    SchemaShapeLimits,
    resolve_ref,
    shape_problem,
    subschemas,
)

_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_VALUE_KEYS = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_MOVED = frozenset({"not", "if", "then", "else", "dependencies", "dependentRequired", "dependentSchemas", "oneOf",
                    "anyOf", "allOf"})
_KEPT_BESIDE_REF = frozenset({"$defs", "definitions", "$id", "id", "$schema", "$anchor"})
_MAX_ONE_OF = 8
_MAX_DEPENDENCIES = 8
_MAX_PASSES = 8
_MAX_KEY_SETS = 64   # branches of a min/maxProperties rewrite
_MAX_NAMES = 256     # keys of a finite propertyNames
_MAX_OPTIONAL_COUNTED = 4  # optional keys split on beside min/maxProperties (2**4 branches)


_REF_OVERRIDES_SIBLINGS = ("draft-03", "draft-04", "draft-06", "draft-07")


def without_ignored_ref_siblings(schema: Any) -> Any:
    """Up to draft 7 a `$ref` overrides every keyword beside it: those keywords go (a copy if any do).

    `{"$ref": "#/definitions/p", "enum": ["a"]}` accepts whatever `p` does under draft 7, and only "a"
    under 2019-09 and later; a schema that names no draft keeps its siblings (the later drafts' reading).
    """
    draft = schema.get("$schema") if isinstance(schema, dict) else None
    if not isinstance(draft, str) or not any(name in draft for name in _REF_OVERRIDES_SIBLINGS):
        return schema
    if not any(isinstance(node, dict) and "$ref" in node and (set(node) & VALIDATION_KEYWORDS) - {"$ref"}
               for _, node, _ in subschemas(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, node, _ in subschemas(schema):  # each node's children are listed after it is yielded
        if isinstance(node, dict) and "$ref" in node:
            for key in [k for k in node if k in VALIDATION_KEYWORDS and k != "$ref"]:
                del node[key]
    return schema


def exact_rewrite(schema: Any) -> Any:
    """`schema` with the rewrites above applied wherever they can be (the input is left alone)."""
    schema = without_ignored_ref_siblings(schema)
    if not isinstance(schema, dict) or shape_problem(schema, SchemaShapeLimits()) is not None:
        return schema
    nodes = [node for _, node, _ in subschemas(schema) if isinstance(node, dict)]
    if not any(_rewritable(node) for node in nodes):
        return schema
    rewriter = _Rewriter(schema)
    if any(_points_into_rewrites(node.get("$ref")) for node in nodes):
        # A $ref into a part that a rewrite moves would lose its target: only the whole may become an enum.
        values = rewriter.finite.filtered(schema)
        return schema if values is None else {"enum": values} if values else False
    return _inline_boolean_refs(rewriter.rewrite(schema, 0))


def _inline_boolean_refs(schema: Any) -> Any:
    """A bare `$ref` to a subschema that became `true`/`false` is that boolean (backends want it inline)."""
    refs = {node["$ref"] for _, node, _ in subschemas(schema) if isinstance(node, dict) and set(node) == {"$ref"}}
    booleans = {ref: target for ref in refs if isinstance(target := resolve_ref(ref, schema), bool)}
    return _replace_refs(schema, booleans, 0) if booleans else schema


def _replace_refs(node: Any, booleans: dict[str, bool], depth: int) -> Any:
    if not isinstance(node, dict) or depth > 200:
        return node
    if set(node) == {"$ref"} and node["$ref"] in booleans:
        return booleans[node["$ref"]]
    node = dict(node)
    for key in _MAP_KEYS:
        if isinstance(node.get(key), dict):
            node[key] = {name: _replace_refs(sub, booleans, depth + 1) for name, sub in node[key].items()}
    for key in (*_LIST_KEYS, *_VALUE_KEYS):
        value = node.get(key)
        if isinstance(value, list):
            node[key] = [_replace_refs(sub, booleans, depth + 1) for sub in value]
        elif isinstance(value, dict):
            node[key] = _replace_refs(value, booleans, depth + 1)
    return node


def _points_into_rewrites(ref: Any) -> bool:
    return isinstance(ref, str) and any(part in _MOVED for part in ref.split("/"))


def _rewritable(node: dict) -> bool:
    return (bool(_MOVED & node.keys()) or (("enum" in node or "const" in node) and len(node) > 1)
            or node.get("minProperties") == 1 or "propertyNames" in node or _requires_forbidden_key(node)
            or (("minProperties" in node or "maxProperties" in node)
                and (node.get("additionalProperties") is False or isinstance(node.get("properties"), dict))))


class _Rewriter:
    def __init__(self, root: dict) -> None:
        self.root = root
        self.finite = FiniteValues(root)
        self.originals = {id(node) for _, node, _ in subschemas(root) if isinstance(node, dict)}

    def rewrite(self, node: Any, depth: int) -> Any:
        if not isinstance(node, dict) or depth > 200:
            return node
        if id(node) in self.originals:
            values = self.finite.filtered(node)
            if values is not None:
                return {"enum": values} if values else False
        node = dict(node)
        if "$ref" in node:  # annotations beside a $ref validate nothing, and some backends refuse them there
            node = {k: v for k, v in node.items() if k in VALIDATION_KEYWORDS or k in _KEPT_BESIDE_REF}
        for _ in range(_MAX_PASSES):
            rewritten = self._rewrite_once(node)
            if rewritten is None:
                break
            node = rewritten
            if not isinstance(node, dict):
                return node
        return self._rewrite_children(node, depth)

    def _rewrite_once(self, node: dict) -> Any | None:
        """`node` after one rewrite of its own keywords; None when none applies."""
        if "not" in node:
            negated = negate(node["not"], self.root)
            if negated is not None:
                return _conjoin({k: v for k, v in node.items() if k != "not"}, negated)
        if "if" in node:
            rewritten = self._if_then_else(node)
            if rewritten is not None:
                return rewritten
        for key in ("dependencies", "dependentRequired", "dependentSchemas"):
            if isinstance(node.get(key), dict):
                rewritten = _dependencies(node, key)
                if rewritten is not None:
                    return rewritten
        if _requires_forbidden_key(node):
            return False
        if "propertyNames" in node:
            rewritten = _property_names(node)
            if rewritten is not None:
                return rewritten
        if ("minProperties" in node or "maxProperties" in node) and node.get("additionalProperties") is False:
            rewritten = _property_count(node)
            if rewritten is not None:
                return rewritten
        if node.get("minProperties") == 1 and isinstance(node.get("properties"), dict) and any(
                sub is not False for sub in node["properties"].values()):
            return _at_least_one_property(node)
        if "minProperties" in node or "maxProperties" in node:
            rewritten = _property_count_by_presence(node)
            if rewritten is not None:
                return rewritten
        if isinstance(node.get("oneOf"), list) and "anyOf" not in node:
            return self._one_of(node)
        return None

    def _if_then_else(self, node: dict) -> Any | None:
        rest = {k: v for k, v in node.items() if k not in ("if", "then", "else")}
        condition, then, otherwise = node["if"], node.get("then", True), node.get("else", True)
        if then is True and otherwise is True:
            return rest
        if subset(condition, then, self.root):  # I and T is I: (I and T) or (not I and E) is I or E
            return _conjoin(rest, _any_of([condition, otherwise]))
        negated = negate(condition, self.root)
        if negated is None:
            return None
        return _conjoin(rest, _any_of([_all_of([condition, then]), _all_of([negated, otherwise])]))

    def _one_of(self, node: dict) -> Any | None:
        branches = node["oneOf"]
        if not branches or len(branches) > _MAX_ONE_OF:
            return None
        factored = self._common_conjuncts(node)
        if factored is not None:
            return factored
        negated = [negate(b, self.root) for b in branches]
        if any(n is None for n in negated):
            return None
        rest = {k: v for k, v in node.items() if k != "oneOf"}
        exclusive = [_all_of([b] + [n for j, n in enumerate(negated) if j != i]) for i, b in enumerate(branches)]
        return _conjoin(rest, _any_of(exclusive))

    def _common_conjuncts(self, node: dict) -> Any | None:
        """`oneOf: [B and C1, .., B and Cn]` is `B and oneOf: [C1, .., Cn]` (B fails: none holds; B holds:
        exactly the Ci decide): the `allOf` members every branch shares leave the oneOf, so only the Ci are
        negated."""
        conjuncts = [self._conjuncts(b) for b in node["oneOf"]]
        if any(c is None for c in conjuncts):
            return None
        keyed = [{json.dumps(m, sort_keys=True): m for m in c} for c in conjuncts]
        common = [key for key in keyed[0] if all(key in k for k in keyed[1:])]
        if not common:
            return None
        rest = {k: v for k, v in node.items() if k != "oneOf"}
        rest["allOf"] = [*rest.get("allOf", []), *(keyed[0][key] for key in common)]
        rest["oneOf"] = [_all_of([m for key, m in k.items() if key not in common]) for k in keyed]
        return rest

    def _conjuncts(self, branch: Any) -> list[Any] | None:
        """The `allOf` members of a branch (through a bare `$ref`); None when it is not only an `allOf`."""
        for _ in range(8):
            if isinstance(branch, dict) and set(branch) & VALIDATION_KEYWORDS == {"$ref"}:
                target = resolve_ref(branch["$ref"], self.root)
                if target is None:
                    return None
                branch = target
        if not isinstance(branch, dict) or set(branch) & VALIDATION_KEYWORDS != {"allOf"} or not isinstance(
                branch["allOf"], list):
            return None
        return list(branch["allOf"])

    def _rewrite_children(self, node: dict, depth: int) -> dict:
        for key in _MAP_KEYS:
            if isinstance(node.get(key), dict):
                node[key] = {name: self.rewrite(sub, depth + 1) for name, sub in node[key].items()}
        for key in _LIST_KEYS:
            if isinstance(node.get(key), list):
                node[key] = [self.rewrite(sub, depth + 1) for sub in node[key]]
        for key in _VALUE_KEYS:
            if key in node:
                value = node[key]
                node[key] = ([self.rewrite(sub, depth + 1) for sub in value] if isinstance(value, list)
                             else self.rewrite(value, depth + 1))
        for key in ("allOf", "anyOf"):
            if isinstance(node.get(key), list):
                members = node[key]
                if key == "allOf" and any(m is False for m in members):
                    return False  # type: ignore[return-value]
                if key == "anyOf":
                    members = [m for m in members if m is not False]
                    if not members:
                        return False  # type: ignore[return-value]
                node[key] = [m for m in members if m is not True and m != {}] if key == "allOf" else members
                if not node[key]:
                    del node[key]
        return node


def _at_least_one_property(node: dict) -> Any:
    """`minProperties: 1` beside optional `properties`: one of them is present, or none is and another key is."""
    declared = list(node["properties"])
    branches: list[Any] = [{"required": [name]} for name in declared]
    if node.get("additionalProperties") is not False or node.get("patternProperties"):
        branches.append({"properties": dict.fromkeys(declared, False), "minProperties": 1})
    rest = {k: v for k, v in node.items() if k != "minProperties"}
    return _conjoin(rest, _any_of(branches))


_OBJECT_SHAPE = ("properties", "required", "patternProperties", "additionalProperties", "minProperties",
                 "maxProperties")


def _property_count_by_presence(node: dict) -> Any | None:
    """min/maxProperties beside optional `properties`: one branch per set of them present (those required,
    the others `false`), each keeping the counts; backends count keys once every listed key is required."""
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
    return _conjoin(rest, _any_of(branches))


def _requires_forbidden_key(node: dict) -> bool:
    """An object-only schema requiring a key that its `properties`/`additionalProperties` forbid."""
    required = node.get("required")
    if node.get("type") != "object" or not isinstance(required, list) or not required:
        return False
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    closed = node.get("additionalProperties") is False and not node.get("patternProperties")
    return any(isinstance(key, str) and (properties.get(key) is False or (closed and key not in properties))
               for key in required)


def _property_count(node: dict) -> Any | None:
    """min/maxProperties of a closed object: the anyOf of its allowed key sets (sizes within the bounds)."""
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
    return _conjoin(rest, _any_of(branches))


def _property_names(node: dict) -> Any | None:
    """`propertyNames` written as the keys it allows (see the module's docstring); None when it cannot be."""
    names = node["propertyNames"]
    rest = {k: v for k, v in node.items() if k != "propertyNames"}
    if names is True or names == {}:
        return rest
    properties = node.get("properties", {})
    if not isinstance(names, dict) or not isinstance(properties, dict) or node.get("patternProperties"):
        return None
    if names is False:
        return {**rest, "properties": {k: False for k in properties}, "additionalProperties": False}
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


def _dependencies(node: dict, key: str) -> Any | None:
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
        clauses.append(_any_of([{"properties": {name: False}}, dependency]))
    rest = {k: v for k, v in node.items() if k != key}
    return _conjoin(rest, _all_of(clauses))


def _conjoin(node: dict, extra: Any) -> Any:
    if extra is False:
        return False
    if extra is True or extra == {}:
        return node
    node = dict(node)
    if isinstance(extra, dict) and set(extra) == {"anyOf"} and "anyOf" not in node:
        node["anyOf"] = extra["anyOf"]  # the same conjunction; backends merge a sibling anyOf more readily
    else:
        node["allOf"] = [*node.get("allOf", []), extra]
    return node


def _all_of(members: list[Any]) -> Any:
    if any(m is False for m in members):
        return False
    kept = [m for m in members if m is not True and m != {}]
    if not kept:
        return True
    return kept[0] if len(kept) == 1 else {"allOf": kept}


def _any_of(members: list[Any]) -> Any:
    if any(m is True or m == {} for m in members):
        return True
    kept = [m for m in members if m is not False]
    if not kept:
        return False
    return kept[0] if len(kept) == 1 else {"anyOf": kept}
