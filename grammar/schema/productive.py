"""Subschemas that no finite JSON value satisfies, written as `false`.

`{"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}`
is a valid schema, yet every object it accepts holds another one inside: no
JSON text ends. Its grammar never completes, so a request under it ran to its
token limit (or, where a branch of an `anyOf` was such a chain, the model could
walk into it and never come out). JSON values are finite, so such a subschema
accepts nothing, and `false` is the same language; the root turning `false` is
answered with a 400 before anything runs.

A subschema is marked as possibly satisfiable when a condition that every
finite value satisfying it must meet holds of its parts (least fixpoint, from
nothing marked): its `$ref` target and each `allOf` member marked, some
`anyOf`/`oneOf` member marked, and one of its types possible: an object whose
required properties' subschemas are marked, an array whose required leading
items (`minItems`) and `contains` are, or any other type. Keywords that only
narrow values (`not`, `if`, bounds, patterns) are not looked at, so a subschema
left unmarked is certain to accept no finite value; a marked one may still
accept nothing (another pass, or the compiled grammar's check, finds those).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from loraplex.grammar.schema.walk import replace_subschemas, resolve_ref, subschemas

_ALL_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


# What a 400 says of a schema that `admits_no_finite_value`.
NO_FINITE_VALUE = ("it accepts no finite JSON value: every value it allows must hold another one inside it, without "
                   "end (a required property or item refers back to the schema that holds it)")


def with_unproductive_as_false(schema: Any) -> Any:
    """`schema` (a copy when anything changes) with every subschema that no finite value satisfies as `false`."""
    found = _copy_with_unproductive(schema)
    if found is None:
        return schema
    schema, dead = found
    if id(schema) in dead:
        return False
    return replace_subschemas(schema, {node_id: False for node_id in dead})


def without_unproductive_choices(schema: Any) -> Any:
    """`schema` (a copy when anything changes) with every `anyOf`/`oneOf` member no finite value satisfies left
    out: for a backend that takes no `false` subschema (xgrammar's structural tags), the one place where such a
    member costs something, a choice the model could walk into and never finish, goes all the same."""
    found = _copy_with_unproductive(schema)
    if found is None:
        return schema
    schema, dead = found
    for _, node, _ in subschemas(schema):
        if not isinstance(node, dict) or id(node) in dead:
            continue
        for key in ("anyOf", "oneOf"):
            members = node.get(key)
            if isinstance(members, list):
                kept = [m for m in members if not (m is False or (isinstance(m, dict) and id(m) in dead))]
                if kept and len(kept) < len(members):
                    node[key] = kept
    return schema


def _copy_with_unproductive(schema: Any) -> tuple[dict, set[int]] | None:
    """A copy of `schema` and the ids of its subschemas no finite value satisfies; None when there are none."""
    if not isinstance(schema, dict) or not _unproductive(schema):
        return None
    schema = copy.deepcopy(schema)
    return schema, _unproductive(schema)  # the same subschemas, found again by the copy's ids


def admits_no_finite_value(schema: Any) -> bool:
    """Whether `schema` accepts no finite JSON value (so certainly nothing a model can write)."""
    return isinstance(schema, dict) and id(schema) in _unproductive(schema)


def _unproductive(root: dict) -> set[int]:
    """The ids of the subschemas of `root` (dicts) that no finite value satisfies: a worklist over who reads
    whom, so a node is looked at again only when a part it reads is marked (a hostile chain of 20,000
    references costs a few passes over it, not one per link)."""
    nodes = {id(node): node for _, node, _ in subschemas(root) if isinstance(node, dict)}
    readers: dict[int, list[dict]] = {}
    for node in nodes.values():
        for part in _parts(node, root):
            if isinstance(part, dict):
                readers.setdefault(id(part), []).append(node)
    live: set[int] = set()
    pending = list(nodes.values())
    while pending:
        node = pending.pop()
        if id(node) in live or not _may_be_finite(node, root, lambda sub: _marked(sub, live, nodes)):
            continue
        live.add(id(node))
        pending.extend(reader for reader in readers.get(id(node), ()) if id(reader) not in live)
    return set(nodes) - live


def _parts(node: dict, root: dict) -> list[Any]:
    """Every subschema whose marking `_may_be_finite` reads for `node`."""
    parts: list[Any] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        parts.append(resolve_ref(ref, root))
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            parts += node[key]
    parts += [_property_schema(node, name) for name in _required(node)]
    parts += [_item_schema(node, i) for i in range(_items_to_check(node))]
    if "contains" in node:
        parts.append(node["contains"])
    return parts


def _marked(sub: Any, live: set[int], nodes: dict[int, dict]) -> bool:
    """Whether `sub` may be satisfiable as far as is known: `true`, marked, or not a subschema the walk
    reached (a reference's target outside the keywords, a malformed value: left to the validators)."""
    if isinstance(sub, bool):
        return sub
    return not isinstance(sub, dict) or id(sub) in live or id(sub) not in nodes


def _may_be_finite(node: dict, root: dict, ok: Callable[[Any], bool]) -> bool:
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = resolve_ref(ref, root)
        if isinstance(target, dict | bool) and not ok(target):
            return False  # an unresolvable or remote reference constrains nothing that is known here
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(ok(sub) for sub in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(ok(sub) for sub in branches):
            return False
    if "enum" in node or "const" in node:
        return True  # the values are given (whether they validate is another pass's concern)
    kinds = node.get("type", _ALL_TYPES)
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list):
        return True
    return any(_type_may_be_finite(kind, node, ok) for kind in kinds)


def _type_may_be_finite(kind: Any, node: dict, ok: Callable[[Any], bool]) -> bool:
    if kind == "object":
        return all(ok(_property_schema(node, name)) for name in _required(node))
    if kind == "array":
        if "contains" in node and _min(node, "minContains", 1) > 0 and not ok(node["contains"]):
            return False
        return all(ok(_item_schema(node, i)) for i in range(_items_to_check(node)))
    return True


def _required(node: dict) -> list[str]:
    required = node.get("required")
    return [name for name in required if isinstance(name, str)] if isinstance(required, list) else []


def _property_schema(node: dict, name: str) -> Any:
    """The subschema a required property's value must satisfy, where it is known for sure (True otherwise)."""
    properties = node.get("properties")
    if isinstance(properties, dict) and name in properties:
        return properties[name]
    if node.get("patternProperties"):
        return True  # a pattern may own the name; its subschema is not the only one that could apply
    return node.get("additionalProperties", True)


def _item_schema(node: dict, index: int) -> Any:
    """The subschema the item at `index` must satisfy (draft 2020-12 `prefixItems`/`items`, draft 4-7 tuples)."""
    prefix = node.get("prefixItems")
    items = node.get("items", True)
    if isinstance(prefix, list):
        return prefix[index] if index < len(prefix) else items
    if isinstance(items, list):  # a draft 4-7 tuple
        return items[index] if index < len(items) else node.get("additionalItems", True)
    return items


def _items_to_check(node: dict) -> int:
    """The leading items whose subschemas a finite array needs: `minItems` of them, but past the tuple's
    positions every item has the same subschema, so one of those is enough."""
    tuple_items = node.get("prefixItems", node.get("items"))
    positions = len(tuple_items) if isinstance(tuple_items, list) else 0
    return min(_min(node, "minItems", 0), positions + 1)


def _min(node: dict, key: str, default: int) -> int:
    value = node.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default
