"""Patterns as regular languages: complements, intersections and lookaheads written as plain regexes.

A pattern without back-references is a regular language, and so are its
complement, its intersection with another, and a pattern whose lookaheads
(`(?!.*--)`) sit outside any repetition. Backends take none of those, but
they take a plain regex of the same language: the expression is built with
`&` and `~` (hash-consed nodes), turned into a minimal DFA by Brzozowski
derivatives over the classes of characters it tells apart, and the DFA is
written back as a regex by state elimination. Sizes are capped (states,
length of the result); past them the caller keeps the keyword it had.

Patterns are read as JSON Schema reads them (ECMA-262, no flags, a match
anywhere unless anchored), and only where every reader agrees: where
ECMA-262 and Python's `re` differ (`\\d`/`\\w` beyond ASCII, `.` and `\\s` at a
few characters, `$` before a final newline) the strings concerned are left
out of the result, so a rewritten pattern never admits a string that either
reading rejects.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

try:
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants
    import sre_parse

MAX_CHAR = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]
# a class escape's category -> (its ranges, whether negated, characters whose membership the readings dispute)
Categories = dict[Any, tuple[Ranges, bool, Ranges]]
_MAX_NODES = 20000
_MAX_PATTERN = 1024  # characters of a pattern read here
_MAX_UNROLL = 32  # a bounded repetition `{m,n}` is unrolled into m + n copies at most
_MAX_LOOKAHEAD_COPIES = 4  # a repetition with a lookahead inside is read count by count, to this many
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
# \s as both readings have it (ECMA-262 adds U+FEFF; Python adds U+001C-U+001F and U+0085): those are left out
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000))
_SPACE_DISPUTED = ((0x1C, 0x1F), (0x85, 0x85), (0xFEFF, 0xFEFF))
_NON_ASCII = ((0x80, MAX_CHAR),)
_LINE_ENDS_DISPUTED = ((0x0D, 0x0D), (0x2028, 0x2029))  # `.` refuses them in ECMA-262, takes them in Python
_CATEGORIES: Categories = {
    sre_constants.CATEGORY_DIGIT: (_DIGIT, False, _NON_ASCII),
    sre_constants.CATEGORY_NOT_DIGIT: (_DIGIT, True, _NON_ASCII),
    sre_constants.CATEGORY_WORD: (_WORD, False, _NON_ASCII),
    sre_constants.CATEGORY_NOT_WORD: (_WORD, True, _NON_ASCII),
    sre_constants.CATEGORY_SPACE: (_SPACE, False, _SPACE_DISPUTED),
    sre_constants.CATEGORY_NOT_SPACE: (_SPACE, True, _SPACE_DISPUTED),
}
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT)  # laziness changes no membership


class Unregular(Exception):
    """The pattern uses something read here as no regular language, or the result would be too large."""


def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def complement(ranges: Ranges) -> Ranges:
    out, low = [], 0
    for lo, hi in normalize(ranges):
        if lo > low:
            out.append((low, lo - 1))
        low = hi + 1
    if low <= MAX_CHAR:
        out.append((low, MAX_CHAR))
    return tuple(out)


class Algebra:
    """Hash-consed regular expressions with `&` and `~`: a node is an int, its shape a tuple in `nodes`.

    Shapes: ("none",), ("eps",), ("set", ranges), ("cat", a, b), ("alt", ids), ("and", ids), ("not", a),
    ("star", a). The constructors keep them in a normal form (flattened, sorted, units dropped), which is
    what makes the derivatives of an expression finitely many.
    """

    def __init__(self) -> None:
        self.nodes: list[tuple] = []
        self._index: dict[tuple, int] = {}
        self._nullable: dict[int, bool] = {}
        self._derivatives: dict[tuple[int, int], int] = {}
        self.none = self._make(("none",))
        self.eps = self._make(("eps",))
        self.anything = self.star(self.chars(((0, MAX_CHAR),)))

    def _make(self, shape: tuple) -> int:
        found = self._index.get(shape)
        if found is None:
            if len(self.nodes) >= _MAX_NODES:
                raise Unregular("too many subexpressions")
            found = self._index[shape] = len(self.nodes)
            self.nodes.append(shape)
        return found

    def chars(self, ranges: Iterable[tuple[int, int]]) -> int:
        normal = normalize(ranges)
        return self._make(("set", normal)) if normal else self.none

    def cat(self, a: int, b: int) -> int:
        if a == self.none or b == self.none:
            return self.none
        if a == self.eps:
            return b
        if b == self.eps:
            return a
        shape = self.nodes[a]
        if shape[0] == "cat":  # right-nested: (xy)z is x(yz)
            return self.cat(shape[1], self.cat(shape[2], b))
        return self._make(("cat", a, b))

    def seq(self, parts: Iterable[int]) -> int:
        out = self.eps
        for part in reversed(list(parts)):
            out = self.cat(part, out)
        return out

    def alt(self, members: Iterable[int]) -> int:
        return self._lattice("alt", members, unit=self.none, zero=self.anything)

    def both(self, members: Iterable[int]) -> int:
        return self._lattice("and", members, unit=self.anything, zero=self.none)

    def _lattice(self, kind: str, members: Iterable[int], unit: int, zero: int) -> int:
        """`alt` and `both`, duals of each other: nested ones of the same kind flattened, `unit` (what the
        operation leaves alone) dropped, `zero` (what it swallows) taking all."""
        flat: set[int] = set()
        for m in members:
            shape = self.nodes[m]
            if shape[0] == kind:
                flat |= set(shape[1])
            elif m != unit:
                flat.add(m)
        if zero in flat:
            return zero
        if not flat:
            return unit
        return next(iter(flat)) if len(flat) == 1 else self._make((kind, tuple(sorted(flat))))

    def negated(self, a: int) -> int:
        shape = self.nodes[a]
        return shape[1] if shape[0] == "not" else self._make(("not", a))

    def star(self, a: int) -> int:
        if a in (self.none, self.eps):
            return self.eps
        return a if self.nodes[a][0] == "star" else self._make(("star", a))

    def repeat(self, a: int, low: int, high: int | None) -> int:
        if low > _MAX_UNROLL or (high is not None and high > _MAX_UNROLL):
            raise Unregular("a repetition too long to unroll")
        optional = self.alt([a, self.eps])
        tail = self.star(a) if high is None else self.seq([optional] * (high - low))
        return self.seq([*([a] * low), tail])

    def nullable(self, a: int) -> bool:
        known = self._nullable.get(a)
        if known is not None:
            return known
        shape = self.nodes[a]
        kind = shape[0]
        if kind in ("eps", "star"):
            result = True
        elif kind in ("none", "set"):
            result = False
        elif kind == "cat":
            result = self.nullable(shape[1]) and self.nullable(shape[2])
        elif kind == "alt":
            result = any(self.nullable(m) for m in shape[1])
        elif kind == "and":
            result = all(self.nullable(m) for m in shape[1])
        else:
            result = not self.nullable(shape[1])
        self._nullable[a] = result
        return result

    def derivative(self, a: int, char: int) -> int:
        """The strings s such that `char` s is in `a`."""
        key = (a, char)
        known = self._derivatives.get(key)
        if known is not None:
            return known
        shape = self.nodes[a]
        kind = shape[0]
        if kind in ("none", "eps"):
            result = self.none
        elif kind == "set":
            result = self.eps if any(lo <= char <= hi for lo, hi in shape[1]) else self.none
        elif kind == "cat":
            head = self.cat(self.derivative(shape[1], char), shape[2])
            result = self.alt([head, self.derivative(shape[2], char)]) if self.nullable(shape[1]) else head
        elif kind == "alt":
            result = self.alt(self.derivative(m, char) for m in shape[1])
        elif kind == "and":
            result = self.both(self.derivative(m, char) for m in shape[1])
        elif kind == "not":
            result = self.negated(self.derivative(shape[1], char))
        else:
            result = self.cat(self.derivative(shape[1], char), a)
        self._derivatives[key] = result
        return result

    def boundaries(self, a: int) -> list[int]:
        """The first code point of each class of characters that `a` cannot tell apart."""
        points = {0}
        seen, stack = set(), [a]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            shape = self.nodes[node]
            if shape[0] == "set":
                for lo, hi in shape[1]:
                    points.add(lo)
                    if hi < MAX_CHAR:
                        points.add(hi + 1)
            elif shape[0] in ("cat",):
                stack += [shape[1], shape[2]]
            elif shape[0] in ("alt", "and"):
                stack += list(shape[1])
            elif shape[0] in ("not", "star"):
                stack.append(shape[1])
        return sorted(points)


class PatternReader:
    """Reads JSON-Schema `pattern`s into one Algebra; `disputed` gathers the characters readers disagree on."""

    def __init__(self, algebra: Algebra) -> None:
        self.algebra = algebra
        self.disputed: list[tuple[int, int]] = []
        self.end_anchored = False

    def read(self, pattern: str) -> int:
        """The strings `pattern` matches somewhere in (a search, as JSON Schema has it)."""
        if len(pattern) > _MAX_PATTERN:
            raise Unregular("a pattern too long")
        try:
            parsed = sre_parse.parse(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            raise Unregular("not a pattern read here") from exc
        if parsed.state.flags & ~sre_constants.SRE_FLAG_UNICODE:
            raise Unregular("inline flags")
        return self._alternatives(list(parsed))

    def _alternatives(self, items: list) -> int:
        """`^a$|^b$`, `(^a$)|b`: each alternative at the top anchored on its own."""
        if len(items) == 1 and items[0][0] == sre_constants.BRANCH:
            return self.algebra.alt(self._alternatives(list(b)) for b in items[0][1][1])
        if len(items) == 1 and items[0][0] == sre_constants.SUBPATTERN and not items[0][1][1] and not items[0][1][2]:
            return self._alternatives(list(items[0][1][3]))
        return self._anchored(items)

    def _anchored(self, items: list) -> int:
        a = self.algebra
        start = bool(items) and items[0] == (sre_constants.AT, sre_constants.AT_BEGINNING)
        end = len(items) > int(start) and items[-1] == (sre_constants.AT, sre_constants.AT_END)
        self.end_anchored |= end
        body = self._sequence(items[int(start):len(items) - int(end)], a.eps if end else a.anything)
        return body if start else a.cat(a.anything, body)

    def _sequence(self, items: list, rest: int) -> int:
        """`items` followed by `rest` (what the pattern still matches after them, to the end of the string):
        a lookahead constrains all of that."""
        a = self.algebra
        for op, arg in reversed(items):
            if op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
                direction, inner = arg
                if direction != 1:
                    raise Unregular("lookbehind")
                ahead = self._sequence(list(inner), a.anything)
                rest = a.both([rest, ahead if op == sre_constants.ASSERT else a.negated(ahead)])
            elif (op, arg) == (sre_constants.AT, sre_constants.AT_END):  # the end of the string: nothing follows
                self.end_anchored = True
                rest = a.eps if a.nullable(rest) else a.none
            elif _has_lookahead([(op, arg)]):
                if op == sre_constants.BRANCH:
                    rest = a.alt(self._sequence(list(b), rest) for b in arg[1])
                elif op == sre_constants.SUBPATTERN and not arg[1] and not arg[2]:
                    rest = self._sequence(list(arg[3]), rest)
                elif op in _REPEATS and arg[1] <= _MAX_LOOKAHEAD_COPIES:  # `(?:(?!x)y)?`: each count apart
                    low, high, inner = arg
                    rest = a.alt(self._sequence(list(inner) * count, rest) for count in range(low, high + 1))
                else:
                    raise Unregular("a lookahead inside an unbounded repetition")
            else:
                rest = a.cat(self._item(op, arg), rest)
        return rest

    def _item(self, op: Any, arg: Any) -> int:
        a = self.algebra
        if op == sre_constants.LITERAL:
            return a.chars([(arg, arg)])
        if op == sre_constants.NOT_LITERAL:
            return a.chars(complement(((arg, arg),)))
        if op == sre_constants.ANY:
            self.disputed += _LINE_ENDS_DISPUTED
            return a.chars(complement(((0x0A, 0x0A), *_LINE_ENDS_DISPUTED)))
        if op == sre_constants.IN:
            return a.chars(self._class(arg))
        if op == sre_constants.BRANCH:
            return a.alt(a.seq(self._item(*i) for i in b) for b in arg[1])
        if op == sre_constants.SUBPATTERN and not arg[1] and not arg[2]:
            return a.seq(self._item(*i) for i in arg[3])
        if op in _REPEATS:
            low, high, inner = arg
            return a.repeat(a.seq(self._item(*i) for i in inner), low,
                            None if high == sre_constants.MAXREPEAT else high)
        raise Unregular("anchors inside, back-references, word boundaries, inline flags")

    def _class(self, items: list) -> Ranges:
        read = class_ranges(items, _CATEGORIES)
        if read is None:
            raise Unregular("a class read here as no set")
        ranges, disputed = read
        self.disputed += disputed
        return ranges


def class_ranges(items: list[Any], categories: Categories) -> tuple[Ranges, Ranges] | None:
    """A parsed class `[...]` (sre_parse's items) as the code points it holds, with the ones whose membership
    the readings behind `categories` dispute; None where a member is no set read here. PatternReader and
    string_lark read classes alike and differ only in their tables (`\\s` is not the same set in both)."""
    ranges: list[tuple[int, int]] = []
    disputed: list[tuple[int, int]] = []
    negate = False
    for op, arg in items:
        if op == sre_constants.NEGATE:
            negate = True
        elif op == sre_constants.LITERAL:
            ranges.append((arg, arg))
        elif op == sre_constants.RANGE:
            ranges.append(arg)
        elif op == sre_constants.CATEGORY and arg in categories:
            members, inverted, unsure = categories[arg]
            ranges += complement(members) if inverted else members
            disputed += unsure
        else:
            return None
    return (complement(tuple(ranges)) if negate else normalize(ranges)), tuple(disputed)


def _has_lookahead(items: list, anchors: bool = True) -> bool:
    """Whether a lookahead (or, with `anchors`, a `$`) sits in `items`: they are read with what follows."""
    stack = list(items)
    while stack:
        op, arg = stack.pop()
        if op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT) or (
                anchors and (op, arg) == (sre_constants.AT, sre_constants.AT_END)):
            return True
        if op == sre_constants.BRANCH:
            stack += [i for b in arg[1] for i in b]
        elif op == sre_constants.SUBPATTERN:
            stack += list(arg[3])
        elif op in _REPEATS:
            stack += list(arg[2])
    return False


def has_lookahead(pattern: Any) -> bool:
    if not isinstance(pattern, str) or "(?" not in pattern:
        return False
    try:
        return _has_lookahead(list(sre_parse.parse(pattern)), anchors=False)
    except (re.error, RecursionError, OverflowError):
        return False
