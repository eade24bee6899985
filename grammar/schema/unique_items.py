"""`uniqueItems` the matchers can check exactly (strings, enum sets, open objects), and the plan of where it applies.

No backend grammar can say "no two items equal" (it is not context-free), so a
schema whose `uniqueItems: true` arrays all qualify is compiled without those
keywords, and every matcher of it watches the JSON text it accepts: a token that
would close a string item equal to an earlier item of the same array is refused
(and masked). That is exactly the schema's language when

- the array's items are strings whose schema never ends a value for good:
  `type: string` with at most `minLength` and a `pattern` after whose complete
  matches another character can always follow (no `maxLength`, `enum`,
  `const` or asserted `format`), so refusing the closing quote of a duplicate
  never leaves generation without a way on (the string grows instead);
- or they come from a finite set of strings (`enum`/`const`, no escapes in
  them, `minItems` no more than there are): then the matcher also masks what
  could only spell a value already used, and a comma once every value is
  used, so again generation always has a way on;
- or they are open objects (`type: object`, any further key allowed, no
  `maxProperties`): a duplicate is refused at its closing `}` (compared as a
  JSON value), and the model can always add a key instead;
- or they are integers that may always grow (`type: integer`, no maximum,
  any minimum at least 0, any `multipleOf`): a duplicate is refused at the
  `,` or `]` after it, and the model can always append a `0` instead (10n
  is as much a multiple, no smaller, and new); a leading `0` when 0 is
  taken is refused at once (nothing may follow it), and a non-zero
  multiple is always there to write;
- or they are numbers without bounds (`type: number` alone): a duplicate is
  refused at the `,` or `]` after it, and a digit (after a `.` where the
  integer part is 0) always makes a new one;
- every way from the root to the `uniqueItems` node is one that must hold for
  an array there: `properties`, `patternProperties`, `additionalProperties`,
  `items`, `prefixItems`, `allOf` and `$ref`, or an `anyOf` branch whose
  siblings admit no array (no object, for a step into an object's keys). Then
  the arrays the matcher checks (those at a path where the `uniqueItems` node
  is reachable) are exactly the arrays the keyword applies to.

Anything else keeps its `uniqueItems`, and a backend that cannot enforce it
refuses it (never a looser grammar).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from loraplex.grammar.schema.finite import JUDGING_ERRORS, offline_validators
from loraplex.grammar.schema.walk import (
    DEFINED_FORMATS,
    VALIDATION_KEYWORDS,
    json_type,
    resolve_ref,
    subschemas,
)

try:  # the public sre_* modules are deprecated aliases of these since Python 3.11
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants
    import sre_parse

_ARRAY, _OBJECT = "array", "object"
_MAX_MEMBERS = 1024
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')
_MAX_NODES = 20000
_MAX_PATH_CACHE = 4096


def _types(node: Any, root: Any, depth: int = 0) -> set[str] | None:
    """The JSON types a subschema admits, if it says (through `$ref`s); None when any type may pass."""
    if node is False:
        return set()
    if not isinstance(node, dict) or depth > 16:
        return None
    if "$ref" in node:
        target = resolve_ref(node["$ref"], root)
        found = _types(target, root, depth + 1) if target is not None else None
        if found is not None:
            return found
    declared = node.get("type")
    if isinstance(declared, str):
        return {"number" if declared == "integer" else declared}
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        return {"number" if t == "integer" else t for t in declared}
    if "const" in node:
        return {json_type(node["const"])}
    if isinstance(node.get("enum"), list):
        return {json_type(v) for v in node["enum"]}
    return None


def _children(node: dict, root: Any) -> list[tuple[Any, str | None]]:
    """(child, the kind of step) for each subschema edge: None = applies to the same value whatever it is,
    'array'/'object' = applies inside an array/object value, '!' = an edge that may not hold."""
    out: list[tuple[Any, str | None]] = []
    if isinstance(node.get("$ref"), str):
        target = resolve_ref(node["$ref"], root)
        out.append((target, None) if target is not None else (None, "!"))
    for member in node.get("allOf") or []:
        out.append((member, None))
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list):
            for i, branch in enumerate(branches):
                siblings = [_types(b, root) for j, b in enumerate(branches) if j != i]
                no_array = all(t is not None and _ARRAY not in t for t in siblings)
                no_object = all(t is not None and _OBJECT not in t for t in siblings)
                kind = "branch:" + ("A" if no_array else "") + ("O" if no_object else "")
                out.append((branch, kind))
    for key in ("properties", "patternProperties"):
        if isinstance(node.get(key), dict):
            out += [(sub, _OBJECT) for sub in node[key].values()]
    if "additionalProperties" in node:
        out.append((node["additionalProperties"], _OBJECT))
    items = node.get("items")
    if isinstance(items, list):
        out += [(sub, _ARRAY) for sub in items]
    elif items is not None:
        out.append((items, _ARRAY))
    for sub in node.get("prefixItems") or []:
        out.append((sub, _ARRAY))
    if "additionalItems" in node:
        out.append((node["additionalItems"], _ARRAY))
    for key in ("not", "if", "then", "else", "contains", "propertyNames", "unevaluatedItems",
                "unevaluatedProperties", "dependentSchemas", "dependencies", "contentSchema"):
        if key in node:
            value = node[key]
            values = value.values() if isinstance(value, dict) and key in ("dependentSchemas", "dependencies") \
                else [value]
            out += [(v, "!") for v in values]
    return out


def _definite_nodes(root: Any) -> dict[int, tuple[bool, bool]] | None:
    """For each reachable subschema (by id): (holds for any array there, holds for any object there)."""
    flags: dict[int, tuple[bool, bool]] = {id(root): (True, True)}
    nodes: dict[int, Any] = {id(root): root}
    work = [root]
    steps = 0
    while work:
        steps += 1
        if steps > _MAX_NODES * 4:
            return None
        node = work.pop()
        if not isinstance(node, dict):
            continue
        for_array, for_object = flags[id(node)]
        for child, kind in _children(node, root):
            if not isinstance(child, dict):
                continue
            if kind is None:
                new = (for_array, for_object)
            elif kind == _ARRAY:
                new = (for_array, for_array)  # inside the array: it is an array, so this node held
            elif kind == _OBJECT:
                new = (for_object, for_object)
            elif kind.startswith("branch:"):
                new = (for_array and "A" in kind, for_object and "O" in kind)
            else:
                new = (False, False)
            old = flags.get(id(child))
            merged = new if old is None else (old[0] and new[0], old[1] and new[1])
            if merged != old:
                flags[id(child)] = merged
                nodes[id(child)] = child
                work.append(child)
    return flags


def _extensible_pattern(pattern: str) -> bool:
    """After any complete match of this (search) pattern, one more character still matches."""
    try:
        parsed = list(sre_parse.parse(pattern))
    except (re.error, sre_constants.error, RecursionError, OverflowError):
        return False
    ends = [i for i, (op, av) in enumerate(parsed) if op == sre_constants.AT and av == sre_constants.AT_END]
    if not ends:
        return not _has_end_anchor(pattern)  # unanchored at the end: any suffix keeps the match
    if ends != [len(parsed) - 1] or len(parsed) < 2 or _has_end_anchor(pattern, skip_last=True):
        return False
    op, av = parsed[-2]
    return op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and av[1] == sre_constants.MAXREPEAT


def _has_end_anchor(pattern: str, skip_last: bool = False) -> bool:
    """A `$` or `\\Z` anywhere (inside groups or branches), but the last top-level one when `skip_last`."""
    text = pattern[:-1] if skip_last and pattern.endswith("$") else pattern
    return bool(re.search(r"(?<!\\)(?:\\\\)*(?:\$|\\Z)", text))


def _items_of(node: dict, root: Any) -> Any:
    items = node.get("items")
    for _ in range(16):
        if isinstance(items, dict) and set(items) & VALIDATION_KEYWORDS == {"$ref"}:
            items = resolve_ref(items["$ref"], root)
    return items


def finite_strings(items: Any) -> list[str] | None:
    """The values of an items schema that is only a set of strings (`enum`/`const`, `type: string`), each spelled
    in JSON without escapes; None for any other schema."""
    if not isinstance(items, dict) or not set(items) & VALIDATION_KEYWORDS <= {"type", "enum", "const"}:
        return None
    if items.get("type", "string") != "string":
        return None
    values = [items["const"]] if "const" in items else items.get("enum")
    if not isinstance(values, list) or not values or len(values) > _MAX_MEMBERS:
        return None
    if not all(isinstance(v, str) and not _NEEDS_ESCAPE.search(v) for v in values):
        return None
    return list(dict.fromkeys(values))


_CLOSING_OBJECT_KEYWORDS = frozenset({
    "maxProperties", "propertyNames", "patternProperties", "unevaluatedProperties", "dependencies",
    "dependentSchemas", "dependentRequired", "if", "then", "else", "not", "allOf", "anyOf", "oneOf", "$ref", "enum",
    "const"})


def open_object(items: Any) -> bool:
    """An object schema that takes one more key of any name and value wherever it could end: refusing the `}`
    of a duplicate item leaves the model that way on."""
    if not isinstance(items, dict) or items.get("type") != "object" or _CLOSING_OBJECT_KEYWORDS & items.keys():
        return False
    extra = items.get("additionalProperties", True)
    return extra is True or extra == {}


def growing_numbers(items: Any) -> str:
    """"integer" for integers with no upper bound and none below 0 when bounded below (appending a `0` to any
    gives another valid one), "number" for numbers without bounds, "" for anything else (see the module
    docstring)."""
    if not isinstance(items, dict) or items.get("type") not in ("integer", "number"):
        return ""
    if items["type"] == "number":
        return "number" if set(items) & VALIDATION_KEYWORDS == {"type"} else ""
    if not set(items) & VALIDATION_KEYWORDS <= {"type", "minimum", "exclusiveMinimum", "multipleOf"}:
        return ""
    for key, least in (("minimum", 0), ("exclusiveMinimum", -1)):
        bound = items.get(key, least)
        if isinstance(bound, bool) or not isinstance(bound, int | float) or bound < least:
            return ""
    step = items.get("multipleOf", 1)
    return "integer" if not isinstance(step, bool) and isinstance(step, int | float) and step > 0 else ""


def _unique_string_items(node: dict, root: Any) -> bool:
    """Whether `node`'s `uniqueItems` can be checked by the matcher exactly (see the module docstring)."""
    if {"prefixItems", "contains", "minContains", "maxContains", "unevaluatedItems", "additionalItems"} & node.keys():
        return False
    items = _items_of(node, root)
    if open_object(items) or growing_numbers(items):
        return True
    members = finite_strings(items)
    if members is not None:
        low = node.get("minItems", 0)
        return isinstance(low, int) and low <= len(members)  # more would leave no value to write
    if not isinstance(items, dict) or items.get("type") != "string":
        return False
    checked = set(items) & VALIDATION_KEYWORDS
    if not checked <= {"type", "minLength", "pattern", "format"}:
        return False
    if "format" in items and isinstance(items["format"], str) and items["format"] in DEFINED_FORMATS:
        return False
    pattern = items.get("pattern")
    return pattern is None or (isinstance(pattern, str) and pattern.isascii() and _extensible_pattern(pattern))


def without_checked_unique_items(schema: Any) -> tuple[Any, UniqueItemsPlan | None]:
    """(`schema` less the `uniqueItems` the matcher will check, the plan to check them), or (schema, None)."""
    if not isinstance(schema, dict):
        return schema, None
    unique = [node for _, node, _ in subschemas(schema) if isinstance(node, dict) and node.get("uniqueItems") is True]
    if not unique:
        return schema, None
    flags = _definite_nodes(schema)
    if flags is None:
        return schema, None
    for node in unique:
        if id(node) in flags and not flags[id(node)][0]:
            return schema, None
        if not _unique_string_items(node, schema):
            return schema, None
    if any(_non_ascii_pattern_key(node) for _, node, _ in subschemas(schema) if isinstance(node, dict)):
        return schema, None
    plan_schema = schema
    stripped = copy.deepcopy(schema)
    for _, node, _ in subschemas(stripped):
        if isinstance(node, dict) and node.get("uniqueItems") is True:
            del node["uniqueItems"]
    return stripped, UniqueItemsPlan(plan_schema)


def _non_ascii_pattern_key(node: dict) -> bool:
    """A `patternProperties` regex on which Python's `re` (ASCII mode) and ECMA-262 may disagree."""
    patterns = node.get("patternProperties")
    return isinstance(patterns, dict) and any(not p.isascii() or re.search(r"\\[sSbB]", p) for p in patterns)


class UniqueItemsPlan:
    """Which arrays (by their path in the instance) must have unique items, from the original schema."""

    def __init__(self, schema: dict) -> None:
        self.root = schema
        self.objects_anywhere = any(isinstance(n, dict) and n.get("uniqueItems") is True
                                    and open_object(_items_of(n, schema)) for _, n, _ in subschemas(schema))
        self._cache: dict[tuple, bool] = {}
        self._members: dict[tuple, frozenset | None] = {}
        self._validators: list[Any] | None = None
        self._patterns: dict[str, re.Pattern | None] = {}

    def objects_at(self, path: tuple) -> bool:
        """Whether the unique array at `path` holds open objects (each compared whole once closed)."""
        return any(isinstance(n, dict) and n.get("uniqueItems") is True and open_object(_items_of(n, self.root))
                   for n in self._nodes_at(path))

    def numbers_at(self, path: tuple) -> str:
        """"integer" or "number" where the unique array at `path` holds numbers that may always grow (each
        compared once closed), "" elsewhere."""
        kinds = {growing_numbers(_items_of(n, self.root)) for n in self._nodes_at(path)
                 if isinstance(n, dict) and n.get("uniqueItems") is True}
        return "integer" if "integer" in kinds else "number" if "number" in kinds else ""

    def members_at(self, path: tuple) -> frozenset | None:
        """For a unique array over a finite set of strings: (UTF-8 text, value) of each value its items may take
        (the values every items schema at the path accepts); None for other arrays."""
        if path in self._members:
            return self._members[path]
        found = None
        nodes = self._nodes_at(path)
        for node in nodes:
            if isinstance(node, dict) and node.get("uniqueItems") is True:
                values = finite_strings(_items_of(node, self.root))
                if values is not None:
                    found = self._accepted_by_all(values, nodes)
                    break
        if len(self._members) < _MAX_PATH_CACHE:
            self._members[path] = found
        return found

    def _accepted_by_all(self, values: list[str], nodes: list[dict]) -> frozenset:
        item_schemas = [self._resolved(n["items"]) for n in nodes if isinstance(n, dict) and "items" in n]
        if self._validators is None:
            self._validators = offline_validators(self.root)
        validators = self._validators
        kept = []
        for value in values:
            try:
                if all(v.evolve(schema=sub).is_valid(value) for sub in item_schemas for v in validators):
                    kept.append((value.encode("utf-8"), value))
            except JUDGING_ERRORS:
                kept.append((value.encode("utf-8"), value))  # cannot judge: the grammar still decides
        return frozenset(kept)

    def _resolved(self, sub: Any) -> Any:
        for _ in range(16):
            if isinstance(sub, dict) and set(sub) & VALIDATION_KEYWORDS == {"$ref"}:
                target = resolve_ref(sub["$ref"], self.root)
                if target is None:
                    break
                sub = target
        return sub

    def unique_at(self, path: tuple) -> bool:
        found = self._cache.get(path)
        if found is None:
            found = any(isinstance(n, dict) and n.get("uniqueItems") is True for n in self._nodes_at(path))
            if len(self._cache) < _MAX_PATH_CACHE:
                self._cache[path] = found
        return found

    def _closure(self, nodes: list[Any]) -> list[dict]:
        seen: dict[int, dict] = {}
        work = list(nodes)
        while work and len(seen) < _MAX_NODES:
            node = work.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen[id(node)] = node
            if isinstance(node.get("$ref"), str):
                target = resolve_ref(node["$ref"], self.root)
                if target is not None:
                    work.append(target)
            for key in ("allOf", "anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    work += node[key]
            for key in ("then", "else"):
                if key in node:
                    work.append(node[key])
        return list(seen.values())

    def _nodes_at(self, path: tuple) -> list[dict]:
        nodes = self._closure([self.root])
        for step in path:
            following: list[Any] = []
            for node in nodes:
                if isinstance(step, str):
                    following += self._member(node, step)
                elif isinstance(step, int):
                    following += self._item(node, step)
            nodes = self._closure(following)
            if not nodes:
                break
        return nodes

    def _member(self, node: dict, key: str) -> list[Any]:
        out: list[Any] = []
        properties = node.get("properties")
        if not isinstance(properties, dict):
            properties = {}
        if key in properties:
            out.append(properties[key])
        matched = False
        for pattern, sub in (node.get("patternProperties") or {}).items():
            compiled = self._pattern(pattern)
            if compiled is not None and compiled.search(key):
                out.append(sub)
                matched = True
        if key not in properties and not matched and "additionalProperties" in node:
            out.append(node["additionalProperties"])
        return out

    def _item(self, node: dict, index: int) -> list[Any]:
        prefix = node.get("prefixItems")
        items = node.get("items")
        if isinstance(prefix, list):
            return [prefix[index]] if index < len(prefix) else [items] if items is not None else []
        if isinstance(items, list):
            if index < len(items):
                return [items[index]]
            return [node["additionalItems"]] if "additionalItems" in node else []
        return [items] if items is not None else []

    def _pattern(self, pattern: str) -> re.Pattern | None:
        if pattern not in self._patterns:
            try:
                self._patterns[pattern] = re.compile(pattern, re.ASCII)
            except re.error:
                self._patterns[pattern] = None
        return self._patterns[pattern]
