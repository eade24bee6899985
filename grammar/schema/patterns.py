"""`pattern`s no string can match, written as what they mean: the subschema admits no string.

A pattern copied from JavaScript with its slashes (`"/^[0-9]{4}$/"`) puts
`^` after a character it must first match, and `$` before one: no string
matches it, under ECMA-262 as under Python's `re` (neither reads them in
multi-line mode), so a string fails the subschema whatever it is. Backends
refuse such anchors (they are not at the ends); written as "no string" they
compile, and the language is the same.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from loraplex.grammar.schema.walk import replace_subschemas, subschemas

try:
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants
    import sre_parse

_NOT_STRING = ["array", "boolean", "null", "number", "object"]
_STARTS = (sre_constants.AT_BEGINNING, sre_constants.AT_BEGINNING_STRING)
_ENDS = (sre_constants.AT_END, sre_constants.AT_END_STRING)


def never_matches(pattern: Any) -> bool:
    """Whether no string contains a match of `pattern`: every alternative at the top has a start anchor after
    something that consumes a character, or an end anchor before one."""
    if not isinstance(pattern, str):
        return False
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return False
    if len(parsed) == 1 and parsed[0][0] == sre_constants.BRANCH:
        alternatives = [sre_parse.SubPattern(parsed.state, list(b)) for b in parsed[0][1][1]]
        return all(_impossible(a) for a in alternatives)
    return _impossible(parsed)


def _impossible(sequence: Any) -> bool:
    items = list(sequence)
    for i, (op, arg) in enumerate(items):
        if op != sre_constants.AT:
            continue
        if arg in _STARTS and sequence[:i].getwidth()[0] > 0:
            return True
        # Python's `$` also matches before a final newline: only what cannot be that newline counts
        if arg in _ENDS and i + 1 < len(items) and sequence[i + 1:].getwidth()[0] > 0 and _not_newline(items[i + 1]):
            return True
    return False


def _not_newline(item: tuple) -> bool:
    op, arg = item
    return op == sre_constants.LITERAL and arg != ord("\n")


def with_unmatchable_patterns_as_no_string(schema: Any) -> Any:
    """`schema` (a copy when anything changes) with each subschema whose `pattern` never matches admitting no
    string: `false` when it is string-only, its other types otherwise."""
    if not any(isinstance(node, dict) and never_matches(node.get("pattern")) for _, node, _ in subschemas(schema)):
        return schema
    schema = copy.deepcopy(schema)
    replaced: dict[int, Any] = {}
    for _, node, _ in subschemas(schema):
        if isinstance(node, dict) and never_matches(node.get("pattern")):
            del node["pattern"]
            if node.get("type") in ("string", ["string"]):
                replaced[id(node)] = False
            else:
                node["allOf"] = [*node.get("allOf", []), {"type": _NOT_STRING}]
    return replace_subschemas(schema, replaced) if replaced else schema
