"""`pattern`s with an end anchor inside (`^(a($|/))*$`), written without it: the same strings match.

Backends take `$` only where it closes the pattern (at its end, or at the end
of a top-level alternative); inside a repetition they refuse it. A `$` inside
says "this match has reached the end of the string", so each part of the
pattern is read as two languages: what it matches when more may follow
(`open`) and what it matches when a `$` in it held, so only empty matches may
follow (`closed`). `(X)*` with X's languages O and E is `O*` open and `O*E`
closed; a sequence `A B` is `A.open B.open` open and `A.open B.closed`, or
`A.closed` where B can match nothing at the end, closed. The pattern is then
`^(?:open[\\s\\S]*|closed)$` (with a leading `[\\s\\S]*` when it was not
anchored at the start). `$` is read as ECMA-262 reads it (the very end):
Python's `re` also lets it match before a final newline, a larger set, so the
rewritten pattern never admits a string either reading rejects. Patterns with
a `^` anywhere but at their start, back-references, lookarounds, word
boundaries or inline flags are left as they are.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from loraplex.grammar.schema.walk import subschemas

try:
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants
    import sre_parse

_MAX_LENGTH = 4096  # a rewritten pattern longer than this is not made
_CATEGORIES = {
    sre_constants.CATEGORY_DIGIT: r"\d", sre_constants.CATEGORY_NOT_DIGIT: r"\D",
    sre_constants.CATEGORY_SPACE: r"\s", sre_constants.CATEGORY_NOT_SPACE: r"\S",
    sre_constants.CATEGORY_WORD: r"\w", sre_constants.CATEGORY_NOT_WORD: r"\W",
}
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT)  # laziness changes no membership


class _Untranslatable(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Languages:
    open: str | None    # a regex of the matches more may follow; None: no such match
    closed: str | None  # a regex of the matches that reached the end of the string
    nullable_at_end: bool  # whether it can match the empty string at the end of the string


def without_inner_end_anchors(pattern: Any) -> str | None:
    """`pattern` rewritten with no `$` but at its end; None when it has none inside or is left as it is."""
    if not isinstance(pattern, str) or "$" not in pattern:
        return None
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None
    items = list(parsed)
    if parsed.state.flags & ~sre_constants.SRE_FLAG_UNICODE:
        return None  # a global inline flag, `(?s)`, `(?i)`: left as it is
    anchored = bool(items) and items[0] == (sre_constants.AT, sre_constants.AT_BEGINNING)
    body = items[1:] if anchored else items
    if not _has_inner_end(body):
        return None
    try:
        languages = _sequence(body)
    except (_Untranslatable, RecursionError):
        return None
    alternatives = []
    if languages.open is not None:
        alternatives.append(languages.open + r"[\s\S]*")
    if languages.closed is not None:
        alternatives.append(languages.closed)
    if not alternatives:
        return None  # no string matches: `with_unmatchable_patterns_as_no_string` says so where it can
    rewritten = "^" + ("" if anchored else r"[\s\S]*") + "(?:" + "|".join(alternatives) + ")$"
    return rewritten if len(rewritten) <= _MAX_LENGTH else None


def _has_inner_end(items: list) -> bool:
    """Whether a `$` sits anywhere but at the pattern's tail (its last item, or the last item of an
    alternative or group there): backends take it at the tail."""
    stack = [(items, True)]
    while stack:
        sequence, tail = stack.pop()
        for i, (op, arg) in enumerate(sequence):
            at_tail = tail and i == len(sequence) - 1
            if (op, arg) == (sre_constants.AT, sre_constants.AT_END) and not at_tail:
                return True
            for child in _child_sequences(op, arg):
                stack.append((list(child), at_tail and op != sre_constants.MAX_REPEAT
                               and op != sre_constants.MIN_REPEAT))
    return False


def _child_sequences(op: Any, arg: Any) -> list:
    if op == sre_constants.BRANCH:
        return list(arg[1])
    if op == sre_constants.SUBPATTERN:
        return [arg[3]]
    if op in _REPEATS:
        return [arg[2]]
    return []


def _sequence(items: list) -> _Languages:
    result = _Languages("", None, True)
    for item in items:
        part = _item(*item)
        opened = _concat(result.open, part.open)
        closed = _union([_concat(result.open, part.closed), result.closed if part.nullable_at_end else None])
        result = _Languages(opened, closed, result.nullable_at_end and part.nullable_at_end)
    return result


def _item(op: Any, arg: Any) -> _Languages:
    if op == sre_constants.AT:
        if arg == sre_constants.AT_END:
            return _Languages(None, "", True)
        raise _Untranslatable  # `^` inside, `\A`, `\Z` (a letter in ECMA-262), word boundaries
    if op == sre_constants.BRANCH:
        branches = [_sequence(list(b)) for b in arg[1]]
        return _Languages(_union([b.open for b in branches]), _union([b.closed for b in branches]),
                          any(b.nullable_at_end for b in branches))
    if op == sre_constants.SUBPATTERN:
        if arg[1] or arg[2]:
            raise _Untranslatable  # inline flags
        return _sequence(list(arg[3]))
    if op in _REPEATS:
        return _repeat(arg[0], arg[1], _sequence(list(arg[2])))
    return _Languages(_character(op, arg), None, False)


def _repeat(low: int, high: int, inner: _Languages) -> _Languages:
    unbounded = high == sre_constants.MAXREPEAT
    opened = _times(inner.open, low, None if unbounded else high)
    closed = None
    if inner.closed is not None and (unbounded or high > 0):
        # The closing pass is some k-th; the passes before it are open ones, those after it match nothing.
        first = 1 if inner.nullable_at_end else max(low, 1)
        before = _times(inner.open, first - 1, None if unbounded else high - 1)
        closed = _concat(before, inner.closed)
    return _Languages(opened, closed, low == 0 or inner.nullable_at_end)


def _times(regex: str | None, low: int, high: int | None) -> str | None:
    if regex is None:
        return "" if low == 0 else None
    if regex == "" or (low, high) == (1, 1):
        return regex
    bounds = f"{{{low},}}" if high is None else f"{{{low}}}" if low == high else f"{{{low},{high}}}"
    return f"(?:{regex}){bounds}"


def _concat(a: str | None, b: str | None) -> str | None:
    return None if a is None or b is None else a + b


def _union(parts: list[str | None]) -> str | None:
    kept = list(dict.fromkeys(p for p in parts if p is not None))
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else "(?:" + "|".join(kept) + ")"


def _character(op: Any, arg: Any) -> str:
    if op == sre_constants.LITERAL:
        return _char(arg)
    if op == sre_constants.NOT_LITERAL:
        return f"[^{_char(arg)}]"
    if op == sre_constants.ANY:
        return "."
    if op == sre_constants.IN:
        out = []
        for inner_op, inner in arg:
            if inner_op == sre_constants.NEGATE:
                out.append("^")
            elif inner_op == sre_constants.LITERAL:
                out.append(_char(inner))
            elif inner_op == sre_constants.RANGE:
                out.append(f"{_char(inner[0])}-{_char(inner[1])}")
            elif inner_op == sre_constants.CATEGORY and inner in _CATEGORIES:
                out.append(_CATEGORIES[inner])
            else:
                raise _Untranslatable
        return "[" + "".join(out) + "]"
    raise _Untranslatable  # back-references, lookarounds, atomic groups, possessive repeats


def _char(code: int) -> str:
    if chr(code).isascii() and chr(code).isalnum():
        return chr(code)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\u{{{code:x}}}"


def with_inner_end_anchors_resolved(schema: Any) -> Any:
    """`schema` (a copy when anything changes) with each `pattern` that has a `$` inside written without it."""
    if not any(isinstance(node, dict) and without_inner_end_anchors(node.get("pattern")) is not None
               for _, node, _ in subschemas(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, node, _ in subschemas(schema):
        if isinstance(node, dict) and (rewritten := without_inner_end_anchors(node.get("pattern"))) is not None:
            node["pattern"] = rewritten
    return schema
