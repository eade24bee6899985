"""Rewrites a JSON schema into keywords the backends enforce, keeping its language exactly.

Each subschema is rewritten by the first of `NODE_REWRITES` that applies,
again until none does (at most `_MAX_PASSES` times), and then its children.
Each rewrite is an identity of JSON Schema:
- `not: S` becomes the complement of S (`negate`), when it can be written;
- `if: I, then: T, else: E` becomes `anyOf: [allOf [I, T], allOf [not I, E]]`,
  or `anyOf: [I, E]` when I is provably a subset of T (`subset`);
- the object keywords of `object_keys` (dependencies, a required key that is
  forbidden, propertyNames, min/maxProperties);
- `oneOf: [B1..Bn]` whose branches may overlap becomes
  `anyOf: [B1 and not B2 .. and not Bn, ...]` (shared `allOf` members first
  taken out of the branches).
Before those, a subschema drawn from a finite set becomes the `enum` of the
values that validate (`finite`). A rewrite whose complement cannot be written
is not made: the keyword stays, and a backend that cannot enforce it refuses
it. Sizes are capped (branches, passes), so a rewrite never multiplies a
schema beyond the compile limits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from loraplex.grammar.schema.connectives import all_of, any_of, conjoin
from loraplex.grammar.schema.finite import FiniteValues
from loraplex.grammar.schema.negate import negate
from loraplex.grammar.schema.object_keys import (
    at_least_one_property,
    closed_property_count,
    dependencies,
    forbidden_required_key,
    property_count_by_presence,
    property_names,
    requires_forbidden_key,
)
from loraplex.grammar.schema.subset import subset
from loraplex.grammar.schema.walk import (
    LIST_KEYS,
    MAP_KEYS,
    VALIDATION_KEYWORDS,
    VALUE_KEYS,
    SchemaShapeLimits,
    resolve_ref,
    shape_problem,
    subschemas,
)

_MOVED = frozenset({"not", "if", "then", "else", "dependencies", "dependentRequired", "dependentSchemas", "oneOf",
                    "anyOf", "allOf"})
_KEPT_BESIDE_REF = frozenset({"$defs", "definitions", "$id", "id", "$schema", "$anchor"})
_MAX_ONE_OF = 8
_MAX_PASSES = 8

# (node, root) -> the node rewritten, or None when the rewrite does not apply to it
NodeRewrite = Callable[[dict, Any], Any | None]


def negated_subschema(node: dict, root: Any) -> Any | None:
    """`not: S` as the complement of S, beside the node's other keywords."""
    if "not" not in node:
        return None
    negated = negate(node["not"], root)
    return None if negated is None else conjoin({k: v for k, v in node.items() if k != "not"}, negated)


def conditional(node: dict, root: Any) -> Any | None:
    """`if`/`then`/`else` as `anyOf: [I and T, not I and E]`, or `I or E` when I implies T."""
    if "if" not in node:
        return None
    rest = {k: v for k, v in node.items() if k not in ("if", "then", "else")}
    condition, then, otherwise = node["if"], node.get("then", True), node.get("else", True)
    if then is True and otherwise is True:
        return rest
    if subset(condition, then, root):  # I and T is I: (I and T) or (not I and E) is I or E
        return conjoin(rest, any_of([condition, otherwise]))
    negated = negate(condition, root)
    if negated is None:
        return None
    return conjoin(rest, any_of([all_of([condition, then]), all_of([negated, otherwise])]))


def overlapping_one_of(node: dict, root: Any) -> Any | None:
    """`oneOf` as the anyOf of each branch without the others (shared allOf members factored out first)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or "anyOf" in node or not branches or len(branches) > _MAX_ONE_OF:
        return None
    factored = _common_conjuncts(node, root)
    if factored is not None:
        return factored
    negated = [negate(b, root) for b in branches]
    if any(n is None for n in negated):
        return None
    rest = {k: v for k, v in node.items() if k != "oneOf"}
    exclusive = [all_of([b] + [n for j, n in enumerate(negated) if j != i]) for i, b in enumerate(branches)]
    return conjoin(rest, any_of(exclusive))


def _common_conjuncts(node: dict, root: Any) -> Any | None:
    """`oneOf: [B and C1, .., B and Cn]` is `B and oneOf: [C1, .., Cn]` (B fails: none holds; B holds:
    exactly the Ci decide): the `allOf` members every branch shares leave the oneOf, so only the Ci are
    negated."""
    found = [_branch_conjuncts(b, root) for b in node["oneOf"]]
    conjuncts = [c for c in found if c is not None]
    if len(conjuncts) < len(found):
        return None
    keyed = [{json.dumps(m, sort_keys=True): m for m in c} for c in conjuncts]
    common = [key for key in keyed[0] if all(key in k for k in keyed[1:])]
    if not common:
        return None
    rest = {k: v for k, v in node.items() if k != "oneOf"}
    rest["allOf"] = [*rest.get("allOf", []), *(keyed[0][key] for key in common)]
    rest["oneOf"] = [all_of([m for key, m in k.items() if key not in common]) for k in keyed]
    return rest


def _branch_conjuncts(branch: Any, root: Any) -> list[Any] | None:
    """The `allOf` members of a branch (through a bare `$ref`); None when it is not only an `allOf`."""
    for _ in range(8):
        if isinstance(branch, dict) and set(branch) & VALIDATION_KEYWORDS == {"$ref"}:
            target = resolve_ref(branch["$ref"], root)
            if target is None:
                return None
            branch = target
    if not isinstance(branch, dict) or set(branch) & VALIDATION_KEYWORDS != {"allOf"} or not isinstance(
            branch["allOf"], list):
        return None
    return list(branch["allOf"])


# The rewrites of one subschema, in the order they are tried.
NODE_REWRITES: tuple[NodeRewrite, ...] = (
    negated_subschema,
    conditional,
    dependencies,
    forbidden_required_key,
    property_names,
    closed_property_count,
    at_least_one_property,
    property_count_by_presence,
    overlapping_one_of,
)


def with_exact_identities(schema: Any) -> Any:
    """`schema` with the rewrites above applied wherever they can be (the input is left alone)."""
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
    return rewriter.rewrite(schema, 0)


def _points_into_rewrites(ref: Any) -> bool:
    return isinstance(ref, str) and any(part in _MOVED for part in ref.split("/"))


def _rewritable(node: dict) -> bool:
    return (bool(_MOVED & node.keys()) or (("enum" in node or "const" in node) and len(node) > 1)
            or node.get("uniqueItems") is True or "contains" in node
            or node.get("minProperties") == 1 or "propertyNames" in node or requires_forbidden_key(node)
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
        """`node` after the first rewrite that applies to it; None when none does."""
        for rewrite in NODE_REWRITES:
            rewritten = rewrite(node, self.root)
            if rewritten is not None:
                return rewritten
        return None

    def _rewrite_children(self, node: dict, depth: int) -> Any:
        for key in MAP_KEYS:
            if isinstance(node.get(key), dict):
                node[key] = {name: self.rewrite(sub, depth + 1) for name, sub in node[key].items()}
        for key in LIST_KEYS:
            if isinstance(node.get(key), list):
                node[key] = [self.rewrite(sub, depth + 1) for sub in node[key]]
        for key in VALUE_KEYS:
            if key in node:
                value = node[key]
                node[key] = ([self.rewrite(sub, depth + 1) for sub in value] if isinstance(value, list)
                             else self.rewrite(value, depth + 1))
        for key in ("allOf", "anyOf"):
            if isinstance(node.get(key), list):
                members = node[key]
                if key == "allOf" and any(m is False for m in members):
                    return False
                if key == "anyOf":
                    members = [m for m in members if m is not False]
                    if not members:
                        return False
                node[key] = [m for m in members if m is not True and m != {}] if key == "allOf" else members
                if not node[key]:
                    del node[key]
        return node
