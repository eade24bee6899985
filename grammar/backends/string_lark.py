"""A string-only JSON schema as one llguidance Lark terminal, where `&` and `~` give `allOf` and `not`.

llguidance's JSON compiler refuses some Boolean mixes of `pattern`s (it must
decide whether each intersection is empty, with a fixed budget, and has no
complement). A schema whose instances are all strings is a regular language,
and a Lark terminal can say it directly: `allOf` is `&`, `anyOf` is `|`, `not`
is `~` (within the valid string contents), `oneOf` is "one and none of the
others", `if` is `(I & T) | (~I & E)`. llguidance decides these lazily, while
masks are computed, within its fuel limits.

The terminal runs over the JSON text of the string, so each character is
written in every form the grammar lets it take: itself (when printable and
not `"` or a backslash), its short escape, or `\\u00XX` for a control
character; `/` also as `\\/`. Every text form decodes to one value and every
value's forms are all in or all out, so `~` and `&` on the text are exactly
`not` and `allOf` on the values. Patterns are read as ECMA-262 regexes without
flags: `.` is any character but a line terminator, `\\d`/`\\w` are ASCII,
anchors only at the ends; anything else (lookarounds, back-references, word
boundaries, `format`) leaves the schema to the JSON compiler (None here).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from loraplex.grammar.schema.regular import Categories, class_ranges, complement, normalize
from loraplex.grammar.schema.walk import VALIDATION_KEYWORDS, resolve_ref

try:
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants
    import sre_parse

_MAX_CHAR = 0x10FFFF
_MAX_DEPTH = 32
_MAX_TERMS = 2048
# The escapes a character may take besides `\u00XX` (control characters only) or itself (printable ones).
_ESCAPED = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r", 0x22: '"', 0x2F: "/", 0x5C: "\\"}
_LINE_TERMINATORS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
# As ECMA-262 reads the classes (the terminal spells each set out, no second reader): nothing disputed
_CATEGORIES: Categories = {
    sre_constants.CATEGORY_DIGIT: (_DIGIT, False, ()), sre_constants.CATEGORY_NOT_DIGIT: (_DIGIT, True, ()),
    sre_constants.CATEGORY_WORD: (_WORD, False, ()), sre_constants.CATEGORY_NOT_WORD: (_WORD, True, ()),
    sre_constants.CATEGORY_SPACE: (_SPACE, False, ()), sre_constants.CATEGORY_NOT_SPACE: (_SPACE, True, ()),
}
# Keywords that constrain other types only: a string passes them.
_NOT_FOR_STRINGS = frozenset({
    "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "contains", "items", "prefixItems", "additionalItems",
    "unevaluatedItems", "maxProperties", "minProperties", "required", "dependentRequired", "dependentSchemas",
    "dependencies", "properties", "patternProperties", "additionalProperties", "propertyNames",
    "unevaluatedProperties",
})
_STRING_KEYWORDS = frozenset({"type", "enum", "const", "pattern", "minLength", "maxLength", "allOf", "anyOf",
                              "oneOf", "not", "$ref", "if", "then", "else"})

_BASE = "BASE"
_EMPTY = None  # the empty language


def string_schema_lark(schema: Any) -> str | None:
    """A Lark grammar accepting exactly the JSON strings `schema` accepts; None when `schema` is not
    string-only or uses something this translation does not cover."""
    if not isinstance(schema, dict) or schema.get("type") != "string":
        return None
    terms = StringTerms(schema)
    try:
        body = terms.term(schema)
    except Untranslatable:
        return None
    if body is _EMPTY:
        return None
    rules = "\n".join(terms.rules())
    return f'start: STR\nSTR: "\\"" T{body} "\\""\n{rules}\n'


class Untranslatable(Exception):
    """The schema uses something the Lark translations (strings here, objects, arrays) do not say."""


class StringTerms:
    """Terminals `T0`, `T1`, ... for string schemas under one root (their `$ref`s resolved there)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.terms: list[str] = []

    def rules(self) -> list[str]:
        return [f"{_BASE}: /{_base_regex()}*/", *(f"T{i}: {text}" for i, text in enumerate(self.terms))]

    def add(self, text: str) -> int:
        if len(self.terms) >= _MAX_TERMS:
            raise Untranslatable
        self.terms.append(text)
        return len(self.terms) - 1

    def term(self, node: Any, depth: int = 0) -> int | None:
        """The index of a terminal for the string contents `node` accepts (None: no string)."""
        if depth > _MAX_DEPTH:
            raise Untranslatable
        if node is True:
            return self.add(_BASE)
        if node is False:
            return _EMPTY
        if not isinstance(node, dict):
            raise Untranslatable
        parts: list[int | None] = []
        for key, value in node.items():
            if key in _NOT_FOR_STRINGS:
                continue
            if key not in _STRING_KEYWORDS:
                if key not in VALIDATION_KEYWORDS:
                    continue  # an annotation
                raise Untranslatable  # format, contentSchema, ...: left to the JSON compiler
            if key in ("then", "else"):
                continue  # read with `if`
            parts.append(self._keyword(key, value, node, depth))
        return self._all(parts)

    def _keyword(self, key: str, value: Any, node: dict[str, Any], depth: int) -> int | None:
        if key == "type":
            types = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
            if types is None:
                raise Untranslatable
            return self.add(_BASE) if "string" in types else _EMPTY
        if key in ("enum", "const"):
            values = [value] if key == "const" else value
            if not isinstance(values, list):
                raise Untranslatable
            strings = [v for v in values if isinstance(v, str)]
            if not strings:
                return _EMPTY
            return self.add(f"/{'|'.join('(?:' + _literal(s) + ')' for s in strings)}/")
        if key == "pattern":
            if not isinstance(value, str):
                raise Untranslatable
            return self.add(f"/{_pattern(value)}/")
        if key in ("minLength", "maxLength"):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise Untranslatable
            bounds = f"{{{value},}}" if key == "minLength" else f"{{0,{value}}}"
            return self.add(f"/(?:{_base_regex()}){bounds}/")
        if key == "$ref":
            target = resolve_ref(value, self.root)
            if target is None:
                raise Untranslatable
            return self.term(target, depth + 1)
        if key in ("allOf", "anyOf", "oneOf"):
            if not isinstance(value, list) or not value:
                raise Untranslatable
            members = [self.term(m, depth + 1) for m in value]
            if key == "allOf":
                return self._all(members)
            if key == "anyOf":
                return self._any(members)
            exactly_one = [self._all([m, *(self._not(o) for j, o in enumerate(members) if j != i)])
                           for i, m in enumerate(members)]
            return self._any(exactly_one)
        if key == "not":
            return self._not(self.term(value, depth + 1))
        condition = self.term(value, depth + 1)  # if
        then = self.term(node.get("then", True), depth + 1)
        otherwise = self.term(node.get("else", True), depth + 1)
        return self._any([self._all([condition, then]), self._all([self._not(condition), otherwise])])

    def _all(self, members: list[int | None]) -> int | None:
        if any(m is _EMPTY for m in members):
            return _EMPTY
        if not members:
            return self.add(_BASE)
        return members[0] if len(members) == 1 else self.add(" & ".join(f"T{m}" for m in members))

    def _any(self, members: list[int | None]) -> int | None:
        kept = [m for m in members if m is not _EMPTY]
        if not kept:
            return _EMPTY
        return kept[0] if len(kept) == 1 else self.add(" | ".join(f"T{m}" for m in kept))

    def _not(self, member: int | None) -> int:
        if member is _EMPTY:
            return self.add(_BASE)
        return self.add(f"~T{member} & {_BASE}")


def _char(code: int) -> str:
    return f"\\x{{{code:x}}}"


def _forms(ranges: Sequence[tuple[int, int]]) -> str:
    """A regex over JSON text for one character from `ranges` (every text form of each)."""
    printable = _subtract(ranges, [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
    options = []
    if printable:
        options.append("[" + "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in printable) + "]")
    backslash = _char(0x5C)
    for lo, hi in normalize(ranges):
        for code in range(lo, min(hi, 0x5C) + 1):
            if code in _ESCAPED:
                options.append(backslash + _char(ord(_ESCAPED[code])))
            if code < 0x20:
                options.append(f"{backslash}u00{code >> 4}{_hex_digit(code & 0xF)}")
    if not options:
        raise Untranslatable  # a class matching no character
    return "(?:" + "|".join(options) + ")"


def _hex_digit(value: int) -> str:
    digit = f"{value:x}"
    return f"[{digit}{digit.upper()}]" if digit.isalpha() else digit


def _base_regex() -> str:
    return _forms([(0, _MAX_CHAR)])


def _literal(text: str) -> str:
    return "".join(_forms([(ord(c), ord(c))]) for c in text)


def _subtract(ranges: Sequence[tuple[int, int]], removed: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for lo, hi in normalize(ranges):
        pieces = [(lo, hi)]
        for r_lo, r_hi in removed:
            pieces = [p for a, b in pieces for p in ((a, min(b, r_lo - 1)), (max(a, r_hi + 1), b)) if p[0] <= p[1]]
        out += pieces
    return out


def _pattern(pattern: str) -> str:
    """The pattern's matches (searched anywhere in the string) as a regex over the JSON text."""
    try:
        items = list(sre_parse.parse(pattern))
    except (re.error, RecursionError, OverflowError) as exc:
        raise Untranslatable from exc
    start = bool(items) and items[0] == (sre_constants.AT, sre_constants.AT_BEGINNING)
    end = len(items) > int(start) and items[-1] == (sre_constants.AT, sre_constants.AT_END)
    inner = items[int(start):len(items) - int(end)]
    base = f"(?:{_base_regex()})*"
    return ("" if start else base) + _sequence(inner) + ("" if end else base)


def _sequence(items: list[Any]) -> str:
    return "".join(_item(op, arg) for op, arg in items)


def _item(op: Any, arg: Any) -> str:
    if op == sre_constants.LITERAL:
        return _forms([(arg, arg)])
    if op == sre_constants.NOT_LITERAL:
        return _forms(complement(((arg, arg),)))
    if op == sre_constants.ANY:
        return _forms(complement(_LINE_TERMINATORS))
    if op == sre_constants.IN:
        return _forms(_class(arg))
    if op == sre_constants.BRANCH:
        return "(?:" + "|".join(_sequence(list(b)) for b in arg[1]) + ")"
    if op == sre_constants.SUBPATTERN and not arg[1] and not arg[2]:
        return "(?:" + _sequence(list(arg[3])) + ")"
    if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
        low, high, sub = arg
        bounds = f"{{{low},}}" if high == sre_constants.MAXREPEAT else f"{{{low},{high}}}"
        return "(?:" + _sequence(list(sub)) + ")" + bounds
    raise Untranslatable  # anchors inside, lookarounds, back-references, word boundaries


def _class(items: list[Any]) -> Sequence[tuple[int, int]]:
    read = class_ranges(items, _CATEGORIES)
    if read is None:
        raise Untranslatable
    return read[0]
