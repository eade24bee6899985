"""The complement of a JSON schema (`not`), written without `not`, where that can be done exactly.

A schema is the conjunction of its keywords, so its complement is the union
(`anyOf`) of each keyword's complement. Most keywords constrain one type
only: `minimum` fails exactly for numbers below it, so its complement is
`{"type": "number", "exclusiveMaximum": m}`, and so on for lengths, counts,
`required`, `properties`, `patternProperties` whose patterns match a finite
set of keys, `items` (beside a small `maxItems` position by position, with
`prefixItems`; else `contains` of the complement), `contains` (`items` of
the complement), `additionalProperties: false` beside a few declared keys
(for each set of them present, more keys than that), `type`, finite
`enum`/`const` sets (strings by a regex of every string outside the set,
numbers by open intervals) and the combinators (De Morgan; `oneOf` fails when
no branch or two branches match). A `pattern` is complemented as a
regular language (`regular_dfa`). A keyword whose complement no backend can
express (`multipleOf`, any other `additionalProperties`,
...) makes `negate` return None: the caller keeps the schema as it is, and the
backend refuses the `not` (never a looser grammar).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import combinations, pairwise
from typing import Any

from loraplex.grammar.schema.regular import Unregular
from loraplex.grammar.schema.regular_dfa import pattern_complement
from loraplex.grammar.schema.walk import DEFINED_FORMATS, VALIDATION_KEYWORDS, json_type, resolve_ref

try:
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants
    import sre_parse

TYPES = ("array", "boolean", "null", "number", "object", "string")
_MAX_DEPTH = 12
_MAX_BRANCHES = 64
_MAX_ENUM = 256
_MAX_ONE_OF = 6
_MAX_FINITE = 64   # keys of a pattern enumerated for a patternProperties complement
_MAX_REPEAT = 4
_MAX_POSITIONS = 8  # items negated position by position (under maxItems)
_MAX_DECLARED = 4   # declared keys of a closed object whose complement is written (2**4 branches)

# keyword -> (the type it constrains, the keyword that is its complement within that type, value map)
_FLIPPED_BOUNDS = {
    "minimum": ("number", "exclusiveMaximum"), "maximum": ("number", "exclusiveMinimum"),
    "exclusiveMinimum": ("number", "maximum"), "exclusiveMaximum": ("number", "minimum"),
}
_COUNTS = {  # minX n fails below n; maxX n fails above n
    "minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1), "maxProperties": ("object", "minProperties", 1),
}


def negate(schema: Any, root: Any, depth: int = 0) -> Any | None:
    """A schema accepting exactly the JSON values `schema` rejects; None when that cannot be written here."""
    if depth > _MAX_DEPTH:
        return None
    if schema is True or schema == {}:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        target = resolve_ref(schema["$ref"], root)
        if target is None:
            return None
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return _union([negate(target, root, depth + 1), negate(rest, root, depth + 1) if rest else False])
    parts: list[Any] = []
    for key, value in schema.items():
        annotation = key == "format" and not (isinstance(value, str) and value in DEFINED_FORMATS)
        if key not in VALIDATION_KEYWORDS or annotation:
            continue  # an annotation or a vendor extension: no instance fails it
        if key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
            return None  # draft 4's boolean form modifies minimum/maximum: not handled here
        parts.append(_negate_keyword(key, value, schema, root, depth))
        if parts[-1] is None:
            return None
    return _union(parts) if parts else False


def _negate_keyword(key: str, value: Any, schema: dict, root: Any, depth: int) -> Any | None:
    if key in _FLIPPED_BOUNDS and isinstance(value, int | float) and not isinstance(value, bool):
        if key.startswith(("min", "max")) and isinstance(schema.get("exclusive" + key.title()), bool):
            return None
        kind, flipped = _FLIPPED_BOUNDS[key]
        return {"type": kind, flipped: value}
    if key in _COUNTS and isinstance(value, int) and not isinstance(value, bool):
        kind, flipped, step = _COUNTS[key]
        bound = value + step
        return False if bound < 0 else {"type": kind, flipped: bound}
    if key == "type":
        return _negate_type(value)
    if key == "required" and isinstance(value, list):
        return _union([{"type": "object", "properties": {name: False}} for name in value]) if value else False
    if key == "properties" and isinstance(value, dict):
        branches = []
        for name, sub in value.items():
            negated = negate(sub, root, depth + 1)
            if negated is None:
                return None
            branches.append(False if negated is False else
                            {"type": "object", "required": [name], "properties": {name: negated}})
        return _union(branches)
    if key in ("additionalProperties", "items", "additionalItems", "propertyNames") and (value is True or value == {}):
        return False  # a free subschema: no value fails it
    if key == "additionalProperties" and value is False and not schema.get("patternProperties"):
        return _some_undeclared_key(schema.get("properties", {}))
    if key == "additionalItems" and not isinstance(schema.get("items"), list):
        return False  # it applies after a tuple `items` only: here no value fails it
    if key == "items" and isinstance(value, dict | bool) and "prefixItems" not in schema:
        # Some item fails: beside `maxItems: n` (whose own complement covers longer arrays), item i fails
        # for some i < n, which `prefixItems` can say position by position.
        # Any longer bound: some item fails, `contains` (which the array grammars say, `array_lark`).
        high = schema.get("maxItems")
        negated = negate(value, root, depth + 1)
        if negated is None or negated is False:
            return negated
        if not isinstance(high, int) or isinstance(high, bool) or high > _MAX_POSITIONS:
            return {"type": "array", "contains": negated}
        return _union([{"type": "array", "minItems": i + 1, "prefixItems": [True] * i + [negated]}
                       for i in range(high)])
    if key == "contains" and not {"minContains", "maxContains"} & schema.keys():
        # No item matches: every item fails it (the empty array included).
        negated = negate(value, root, depth + 1)
        if negated is None:
            return None
        return {"type": "array", "maxItems": 0} if negated is False else {"type": "array", "items": negated}
    if key == "patternProperties" and isinstance(value, dict):
        # Some key matching a pattern has a value its subschema rejects: with each pattern's keys a finite
        # set, one of those keys is present with such a value.
        branches = []
        for pattern, sub in value.items():
            negated = negate(sub, root, depth + 1)
            if negated is False:
                continue
            names = finite_matches(pattern) if isinstance(pattern, str) and negated is not None else None
            if names is None:
                return None
            branches += [{"type": "object", "required": [name], "properties": {name: negated}} for name in names]
        return _union(branches)
    if key == "propertyNames" and isinstance(value, dict) and set(value) == {"not"}:
        # Some key is not a name: with the names' complement a finite set, one of them is present.
        names = value["not"]
        if isinstance(names, dict) and set(names) - {"type"} == {"const"} and isinstance(names["const"], str):
            present = [names["const"]]
        elif isinstance(names, dict) and set(names) - {"type"} == {"enum"} and isinstance(names["enum"], list):
            present = [n for n in names["enum"] if isinstance(n, str)]
        else:
            return None
        if names.get("type", "string") != "string":
            return None
        return _union([{"type": "object", "required": [name]} for name in present])
    if key == "pattern" and isinstance(value, str):
        return _strings_not_matching(value)
    if key == "enum" and isinstance(value, list):
        return _negate_values(value)
    if key == "const":
        return _negate_values([value])
    if key == "not":
        return value
    if key == "allOf" and isinstance(value, list):
        return _union([negate(sub, root, depth + 1) for sub in value])
    if key == "anyOf" and isinstance(value, list):
        negated = [negate(sub, root, depth + 1) for sub in value]
        if any(n is None for n in negated):
            return None
        if any(n is False for n in negated):
            return False
        return {"allOf": negated} if len(negated) != 1 else negated[0]
    if key == "oneOf" and isinstance(value, list) and 0 < len(value) <= _MAX_ONE_OF:
        # Not exactly one: none matches, or some two match.
        negated = [negate(sub, root, depth + 1) for sub in value]
        if any(n is None for n in negated):
            return None
        none = False if any(n is False for n in negated) else {"allOf": negated} if len(negated) > 1 else negated[0]
        pairs = [{"allOf": [a, b]} for i, a in enumerate(value) for b in value[i + 1:]]
        return _union([none, *pairs])
    return None


def _strings_not_matching(pattern: str) -> Any | None:
    """The strings `pattern` does not match, as the plain regex of the complement (`regular_dfa`)."""
    try:
        outside = pattern_complement(pattern)
    except Unregular:
        return None
    return False if outside is None else {"type": "string", "pattern": outside}


def _some_undeclared_key(properties: Any) -> Any | None:
    """Objects with a key `properties` does not declare: for each set of the declared keys present (the others
    absent), more keys than that set."""
    if not isinstance(properties, dict) or len(properties) > _MAX_DECLARED:
        return None
    declared = sorted(properties)
    branches: list[Any] = []
    for size in range(len(declared) + 1):
        for present in combinations(declared, size):
            absent = {k: False for k in declared if k not in present}
            branch: dict[str, Any] = {"type": "object", "minProperties": size + 1}
            if present:
                branch["required"] = list(present)
            if absent:
                branch["properties"] = absent
            branches.append(branch)
    return _union(branches)


def _union(branches: Sequence[Any | None]) -> Any | None:
    if any(b is None for b in branches):
        return None
    if any(b is True for b in branches):
        return True
    kept = [b for b in branches if b is not False]
    if not kept:
        return False
    if len(kept) > _MAX_BRANCHES:
        return None
    return kept[0] if len(kept) == 1 else {"anyOf": kept}


def _negate_type(value: Any) -> Any | None:
    declared = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
    if declared is None or not declared <= {*TYPES, "integer"}:
        return None
    if "integer" in declared and "number" not in declared:
        return None  # the numbers that are not integers have no type keyword of their own
    rest = [t for t in TYPES if t not in declared]
    return {"type": rest} if rest else False


def _negate_values(values: list[Any]) -> Any | None:
    """Every JSON value outside the finite set `values`."""
    if len(values) > _MAX_ENUM:
        return None
    by_type: dict[str, list[Any]] = {}
    for v in values:
        by_type.setdefault(json_type(v), []).append(v)
    if {"array", "object"} & by_type.keys():
        return None
    branches: list[Any] = [{"type": [t for t in TYPES if t not in by_type]}] if len(by_type) < len(TYPES) else []
    if "boolean" in by_type:
        left = [b for b in (False, True) if b not in by_type["boolean"]]
        if left:
            branches.append({"const": left[0]})
    if "string" in by_type:
        branches.append({"type": "string", "pattern": strings_outside(by_type["string"])})
    if "number" in by_type:
        branches += _numbers_outside(by_type["number"])
    return _union(branches)


def _numbers_outside(numbers: list[Any]) -> list[Any]:
    points = sorted(set(numbers))
    branches: list[Any] = [{"type": "number", "exclusiveMaximum": points[0]}]
    for low, high in pairwise(points):
        branches.append({"type": "number", "exclusiveMinimum": low, "exclusiveMaximum": high})
    branches.append({"type": "number", "exclusiveMinimum": points[-1]})
    return branches


def strings_outside(strings: list[str]) -> str:
    """An anchored regex matching exactly the strings not in `strings` (over a trie of them)."""
    trie: dict = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}
    return f"^(?:{_outside(trie)})$"


def _outside(node: dict) -> str:
    # Iterative post-order over the trie, so a long string cannot exhaust the stack.
    stack: list[tuple[dict, bool]] = [(node, False)]
    done: dict[int, str] = {}
    while stack:
        current, expanded = stack.pop()
        children = [ch for ch in current if ch]
        if not expanded:
            stack.append((current, True))
            stack.extend((current[ch], False) for ch in children)
            continue
        alternatives = [] if "" in current else [""]
        if children:
            excluded = "".join(_char(ch) for ch in sorted(children))
            alternatives.append(f"[^{excluded}][\\s\\S]*")
        else:
            alternatives.append("[\\s\\S]+")
        alternatives += [f"{_char(ch)}(?:{done[id(current[ch])]})" for ch in sorted(children)]
        done[id(current)] = "|".join(alternatives)
    return done[id(node)]


def _char(ch: str) -> str:
    return f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\u{{{ord(ch):x}}}"


def finite_matches(pattern: str) -> list[str] | None:
    """Every string an anchored pattern (`^...$`) of literals, small classes, alternation and bounded
    repetition matches; None for any other pattern or more than a few dozen strings."""
    try:
        items = list(sre_parse.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return None
    if (len(items) < 2 or items[0] != (sre_constants.AT, sre_constants.AT_BEGINNING)
            or items[-1] != (sre_constants.AT, sre_constants.AT_END)):
        return None
    found = _finite(items[1:-1])
    return None if found is None else sorted(set(found))


def _finite(items: list[Any]) -> list[str] | None:
    strings = [""]
    options: list[str] | None
    for op, arg in items:
        if op == sre_constants.LITERAL:
            options = [chr(arg)]
        elif op == sre_constants.IN:
            options = _class_members(arg)
        elif op == sre_constants.BRANCH:
            options = []
            for branch in arg[1]:
                found = _finite(list(branch))
                if found is None:
                    return None
                options += found
        elif op == sre_constants.SUBPATTERN and not arg[1] and not arg[2]:
            options = _finite(list(arg[3]))
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and arg[1] <= _MAX_REPEAT:
            inner = _finite(list(arg[2]))
            options = None if inner is None else _repeats(inner, arg[0], arg[1])
        else:
            return None  # `.`, categories, anchors inside, lookarounds, unbounded repetition
        if options is None or len(strings) * len(options) > _MAX_FINITE:
            return None
        strings = [a + b for a in strings for b in options]
    return strings


def _class_members(items: list) -> list[str] | None:
    members: list[str] = []
    for op, arg in items:
        if op == sre_constants.LITERAL:
            members.append(chr(arg))
        elif op == sre_constants.RANGE and arg[1] - arg[0] < _MAX_FINITE:
            members += [chr(c) for c in range(arg[0], arg[1] + 1)]
        else:
            return None  # negated sets and categories (\d is not the same set in ECMA-262 and Python)
    return members


def _repeats(options: list[str], low: int, high: int) -> list[str] | None:
    out: list[str] = []
    current = [""]
    for count in range(high + 1):
        if count >= low:
            out += current
        if len(out) > _MAX_FINITE:
            return None
        current = [a + b for a in current for b in options] if count < high else []
    return out
