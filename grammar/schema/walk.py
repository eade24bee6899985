"""Walks over a JSON schema's subschemas without recursion, so no tenant schema can exhaust the stack.

Every check that looks inside a schema (its depth and size, the first keyword
a backend cannot enforce, where a keyword sits) goes through `subschemas`,
an explicit stack of (JSON-pointer path, subschema, depth). The vocabulary of
JSON Schema that the passes and backends share is declared here too: the
keywords that hold subschemas, those that validate, and the defined formats.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# The keywords whose values hold subschemas: by name, in a list, or one subschema (a list in draft 4's `items`).
MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
VALUE_KEYS = (
    "items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems",
)

# Every keyword of JSON Schema (drafts 4 to 2020-12) that can make an instance invalid. Any other key
# is an annotation or a vendor extension, ignored by validators, so no backend needs to enforce it.
VALIDATION_KEYWORDS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains",
    "minContains", "contains", "items", "prefixItems", "additionalItems", "unevaluatedItems", "maxProperties",
    "minProperties", "required", "dependentRequired", "dependentSchemas", "dependencies", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "unevaluatedProperties", "allOf", "anyOf",
    "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef", "contentSchema",
})


# The format vocabulary of drafts 4 to 2020-12 (draft 3's own: `schema.formats`). A format outside it is an
# annotation: validators ignore unknown formats.
DEFINED_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex",
})


@dataclass(frozen=True, slots=True)
class SchemaShapeLimits:
    max_depth: int = 64     # nesting of subschemas
    max_nodes: int = 20000  # subschemas in all


def subschemas(schema: Any) -> Iterator[tuple[str, Any, int]]:
    """(path, subschema, depth) for the schema and every subschema in it, depth first."""
    stack: list[tuple[str, Any, int]] = [("#", schema, 0)]
    while stack:
        path, node, depth = stack.pop()
        yield path, node, depth
        if not isinstance(node, dict):
            continue
        children: list[tuple[str, Any, int]] = []
        for key in MAP_KEYS:
            value = node.get(key)
            if isinstance(value, dict):
                children += [(f"{path}/{key}/{name}", sub, depth + 1) for name, sub in value.items()]
        dependencies = node.get("dependencies")
        if isinstance(dependencies, dict):
            children += [(f"{path}/dependencies/{name}", sub, depth + 1)
                         for name, sub in dependencies.items() if isinstance(sub, dict | bool)]
        for key in LIST_KEYS:
            value = node.get(key)
            if isinstance(value, list):
                children += [(f"{path}/{key}/{i}", sub, depth + 1) for i, sub in enumerate(value)]
        for key in VALUE_KEYS:
            if key not in node:
                continue
            value = node[key]
            if isinstance(value, list):  # draft-4 tuple `items`
                children += [(f"{path}/{key}/{i}", sub, depth + 1) for i, sub in enumerate(value)]
            else:
                children.append((f"{path}/{key}", value, depth + 1))
        stack.extend(reversed(children))


def value_nesting_limit(limits: SchemaShapeLimits) -> int:
    """How deep any JSON value in a schema may nest: two levels a subschema (`properties` -> name -> subschema),
    and room for `const`, `enum`, `default` and `examples` values within the deepest. A value nested deeper is
    refused before anything recursive (jsonschema, copies, the passes) sees it."""
    return 2 * limits.max_depth + 32


def value_nesting_problem(value: Any, max_nesting: int) -> str | None:
    """Why `value` (any JSON) nests too deep to accept, walked without recursion; None when it does not."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_nesting:
            return f"it nests deeper than {max_nesting} levels of JSON"
        if isinstance(node, dict):
            stack.extend((item, depth + 1) for item in node.values())
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
    return None


def shape_problem(schema: Any, limits: SchemaShapeLimits) -> str | None:
    """Why `schema` is too deep or too large to accept; None when it is within the limits."""
    for num_nodes, (path, _, depth) in enumerate(subschemas(schema), start=1):
        if depth > limits.max_depth:
            return f"it nests deeper than {limits.max_depth} levels (at {_short(path)})"
        if num_nodes > limits.max_nodes:
            return f"it has more than {limits.max_nodes} subschemas"
    return value_nesting_problem(schema, value_nesting_limit(limits))


def keyword_path(schema: Any, keyword: str) -> str | None:
    """The path of the first subschema that uses `keyword`."""
    for path, node, _ in subschemas(schema):
        if isinstance(node, dict) and keyword in node:
            return path
    return None


def first_keyword_outside(schema: Any, allowed: frozenset[str], formats: frozenset[str]) -> tuple[str, str] | None:
    """(keyword, path) of the first validation keyword not in `allowed` (or a defined format not in `formats`)."""
    for path, node, _ in subschemas(schema):
        if not isinstance(node, dict):
            continue
        for key in node:
            if key in VALIDATION_KEYWORDS and key not in allowed:
                return key, path
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in DEFINED_FORMATS and fmt not in formats:
            return f"format: {fmt}", path
    return None


def replace_subschemas(node: Any, replaced: dict[int, Any]) -> Any:
    """`node` with the subschemas named by id swapped for their replacement, in place (walked without recursion)."""
    if id(node) in replaced:
        return replaced[id(node)]
    for _, parent, _ in subschemas(node):
        if not isinstance(parent, dict):
            continue
        for key, value in parent.items():
            if isinstance(value, dict):
                if id(value) in replaced:
                    parent[key] = replaced[id(value)]
                else:
                    for name, sub in value.items():
                        if id(sub) in replaced:
                            value[name] = replaced[id(sub)]
            elif isinstance(value, list):
                parent[key] = [replaced.get(id(sub), sub) for sub in value]
    return node


def resolve_ref(ref: Any, root: Any) -> Any | None:
    """The subschema a local `$ref` (`#/a/b`, JSON-pointer escapes) names; None for any other reference."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    target: Any = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict):
            target = target.get(part)
        elif isinstance(target, list) and part.isascii() and part.isdigit() and len(part) < 10 and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
        if target is None:
            return None
    return target


def _short(path: str) -> str:
    return path if len(path) <= 120 else path[:60] + "..." + path[-50:]


def json_type(value: Any) -> str:
    """The JSON Schema type of a parsed JSON value ("number" for integers too: a type set, not the narrowest)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names[type(value)]


MAX_CONJUNCTS = 32  # a schema whose allOf/$ref closure is larger is not taken apart


def conjuncts(node: Any, root: Any) -> list[dict] | None:
    """Every schema an instance of `node` must match: `node` itself, its `allOf` members and `$ref` targets,
    transitively (`true` dropped). None where one is not a schema object, a reference does not resolve, or
    there are more than MAX_CONJUNCTS of them."""
    out: list[dict] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if current is True:
            continue
        if not isinstance(current, dict) or len(out) >= MAX_CONJUNCTS:
            return None
        out.append(current)
        if isinstance(current.get("$ref"), str):
            target = resolve_ref(current["$ref"], root)
            if target is None:
                return None
            stack.append(target)
        if isinstance(current.get("allOf"), list):
            stack.extend(current["allOf"])
    return out
