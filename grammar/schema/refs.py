"""The passes about `$ref`: every target in view, siblings a draft ignores dropped, boolean targets inlined."""

from __future__ import annotations

import copy
from typing import Any

from loraplex.grammar.schema.walk import (
    LIST_KEYS,
    MAP_KEYS,
    VALIDATION_KEYWORDS,
    VALUE_KEYS,
    resolve_ref,
    subschemas,
)

_HOISTED = "$defs"
_MAX_HOISTED = 256
_REF_OVERRIDES_SIBLINGS = ("draft-03", "draft-04", "draft-06", "draft-07")


def with_reachable_ref_targets(schema: Any) -> Any:
    """`schema` with every local `$ref` target that `subschemas` does not walk copied under `$defs` (a copy).

    A `$ref` may point anywhere by JSON pointer, also inside a key no keyword defines
    (`{"definitions": {"a": {"full": {...}}}, "$ref": "#/definitions/a/full"}`); the passes that
    rewrite subschemas only see what `subschemas` walks, so such a target is copied to a `$defs` entry
    and its references repointed there: the same schema, every part of it now in view.
    """
    if not isinstance(schema, dict) or not isinstance(schema.get(_HOISTED, {}), dict):
        return schema
    existing = schema.get(_HOISTED, {})
    moved: dict[str, str] = {}
    hoisted: dict[str, Any] = {}
    while True:
        combined = {**schema, _HOISTED: {**existing, **hoisted}}
        walked = {id(schema)} | {id(node) for _, node, _ in subschemas(combined)}
        missing = []
        for _, node, _ in subschemas(combined):
            ref = node.get("$ref") if isinstance(node, dict) else None
            if isinstance(ref, str) and ref.startswith("#/") and ref not in moved:
                target = resolve_ref(ref, schema)
                if isinstance(target, dict | bool) and id(target) not in walked:
                    missing.append((ref, target))
        if not missing:
            break
        for ref, target in missing:
            if ref not in moved:
                if len(moved) >= _MAX_HOISTED:
                    return schema
                number = len(moved)
                while f"ref{number}" in existing or f"ref{number}" in hoisted:
                    number += 1
                name = f"ref{number}"
                moved[ref] = f"#/{_HOISTED}/{name}"
                hoisted[name] = target
    if not moved:
        return schema
    out = copy.deepcopy(combined)
    for _, node, _ in subschemas(out):
        if isinstance(node, dict) and node.get("$ref") in moved:
            node["$ref"] = moved[node["$ref"]]
    return out


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


def with_boolean_refs_inlined(schema: Any) -> Any:
    """A bare `$ref` to a subschema that is `true`/`false` is that boolean (backends want it inline)."""
    refs = {node["$ref"] for _, node, _ in subschemas(schema) if isinstance(node, dict) and set(node) == {"$ref"}}
    booleans = {ref: target for ref in refs if isinstance(target := resolve_ref(ref, schema), bool)}
    return _replace_refs(schema, booleans, 0) if booleans else schema


def _replace_refs(node: Any, booleans: dict[str, bool], depth: int) -> Any:
    if not isinstance(node, dict) or depth > 200:
        return node
    if set(node) == {"$ref"} and node["$ref"] in booleans:
        return booleans[node["$ref"]]
    node = dict(node)
    for key in MAP_KEYS:
        if isinstance(node.get(key), dict):
            node[key] = {name: _replace_refs(sub, booleans, depth + 1) for name, sub in node[key].items()}
    for key in (*LIST_KEYS, *VALUE_KEYS):
        value = node.get(key)
        if isinstance(value, list):
            node[key] = [_replace_refs(sub, booleans, depth + 1) for sub in value]
        elif isinstance(value, dict):
            node[key] = _replace_refs(value, booleans, depth + 1)
    return node
