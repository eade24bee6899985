"""From a regular expression of `regular.Algebra` back to a plain regex: a minimal DFA, then state elimination.

The public functions read JSON-Schema `pattern`s (`regular.PatternReader`)
and answer with an anchored plain regex (`^(?:...)$`) of the language asked
for, None when that language is empty, or raise `Unregular` when it cannot
be written here within the size limits. The result is restricted to the
strings every reader of the patterns agrees on (see `regular`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from loraplex.grammar.schema.regular import (
    MAX_CHAR,
    Algebra,
    PatternReader,
    Ranges,
    Unregular,
    complement,
    normalize,
)

_MAX_STATES = 96
_MAX_CLASSES = 256
_MAX_LENGTH = 4096

# A regex being written: (text, precedence): 0 an alternation, 1 a concatenation, 2 an atom. EPS: the empty one.
_Regex = tuple[str, int]
EPS: _Regex = ("", 2)


@functools.lru_cache(maxsize=1024)  # negate() asks again for the same pattern as a rewrite proceeds
def pattern_complement(pattern: str) -> str | None:
    """The strings `pattern` does not match (anywhere in them)."""
    return _language(lambda reader, a: a.negated(reader.read(pattern)))


@functools.lru_cache(maxsize=1024)
def plain_pattern(pattern: str) -> str | None:
    """The strings `pattern` matches, as a regex without lookaheads."""
    return _language(lambda reader, a: reader.read(pattern))


def patterns_region(inside: Iterable[str], outside: Iterable[str], *, exact: bool = False) -> str | None:
    """The strings that match every pattern of `inside` and none of `outside`. `exact`: the region as ECMA-262
    reads the patterns, with no string left out (`Unregular` where a class the readers dispute is used)."""
    inside, outside = list(inside), list(outside)
    return _language(lambda reader, a: a.both([*(reader.read(p) for p in inside),
                                               *(a.negated(reader.read(p)) for p in outside)]), exact=exact)


def _language(build: Callable[[PatternReader, Algebra], int], exact: bool = False) -> str | None:
    algebra = Algebra()
    reader = PatternReader(algebra)
    try:
        root = build(reader, algebra)
        if exact:
            if reader.disputed:
                raise Unregular("a class the readers dispute")
            return write_regex(algebra, root)
        agreed = [algebra.star(algebra.chars(complement(tuple(reader.disputed))))]
        if reader.end_anchored:  # Python's `$` also matches before a final newline, ECMA-262's does not
            agreed.append(algebra.negated(algebra.cat(algebra.anything, algebra.chars([(0x0A, 0x0A)]))))
        return write_regex(algebra, algebra.both([root, *agreed]))
    except RecursionError as exc:  # a long run of optional parts nests the derivatives deeply
        raise Unregular("nested too deeply") from exc


def write_regex(algebra: Algebra, root: int) -> str | None:
    """An anchored regex of the language `root`; None when it is empty."""
    states, moves, accepting = _minimal_dfa(algebra, root)
    if not accepting:
        return None
    body = _eliminate(len(states), moves, accepting)
    return "^" + _group(body) + "$" if body != EPS else "^$"


def _minimal_dfa(algebra: Algebra, root: int) -> tuple[list[int], list[dict[int, Ranges]], set[int]]:
    """States (expressions), per state the characters leading to each next state (live states only), and
    the accepting states; numbered by first reach, merged where they accept the same strings."""
    points = algebra.boundaries(root)
    if len(points) > _MAX_CLASSES:
        raise Unregular("too many classes of characters")
    classes = [(lo, (points[i + 1] - 1) if i + 1 < len(points) else MAX_CHAR) for i, lo in enumerate(points)]
    number = {root: 0}
    states = [root]
    raw: list[list[int]] = []
    for state in states:  # grows while read
        row = []
        for lo, _ in classes:
            target = algebra.derivative(state, lo)
            if target not in number:
                if len(states) >= 4 * _MAX_STATES:
                    raise Unregular("too many states")
                number[target] = len(states)
                states.append(target)
            row.append(number[target])
        raw.append(row)
    final = {i for i, s in enumerate(states) if algebra.nullable(s)}
    live = set(final)
    while True:
        grown = live | {i for i, row in enumerate(raw) if any(t in live for t in row)}
        if grown == live:
            break
        live = grown
    if 0 not in live:
        return [root], [{}], set()
    block = {i: int(i in final) for i in live}
    while True:  # Moore's refinement: states apart once their moves lead to states apart
        signature = {i: (block[i], tuple(block.get(t, -1) for t in raw[i])) for i in sorted(live)}
        names: dict[tuple, int] = {}
        refined = {i: names.setdefault(sig, len(names)) for i, sig in signature.items()}
        if len(names) == len(set(block.values())):
            break
        block = refined
    order = {b: n for n, b in enumerate(dict.fromkeys(block[i] for i in sorted(live)))}
    if len(order) > _MAX_STATES:
        raise Unregular("too many states")
    moves: list[dict[int, list[tuple[int, int]]]] = [{} for _ in order]
    for i in sorted(live):
        here = order[block[i]]
        if moves[here]:
            continue  # a merged state's moves are its first member's
        for (lo, hi), t in zip(classes, raw[i], strict=True):
            if t in live:
                moves[here].setdefault(order[block[t]], []).append((lo, hi))
    merged_moves = [{t: normalize(ranges) for t, ranges in row.items()} for row in moves]
    return list(order), merged_moves, {order[block[i]] for i in final if i in live}


def _eliminate(num_states: int, moves: list[dict[int, Ranges]], accepting: set[int]) -> _Regex:
    """State elimination: a start state and an end state around the DFA, then every DFA state removed in turn,
    the paths through it written on the edges that bypass it."""
    start, end = num_states, num_states + 1
    edges: dict[int, dict[int, _Regex]] = {i: {} for i in range(num_states + 2)}
    for i, row in enumerate(moves):
        for t, ranges in row.items():
            edges[i][t] = _chars(ranges)
    edges[start][0] = EPS
    for f in accepting:
        edges[f][end] = _alt([edges[f].get(end), EPS])
    left = set(range(num_states))
    while left:
        q = min(left, key=lambda s: (sum(1 for p in edges if s in edges[p] and p != s)
                                     * sum(1 for t in edges[s] if t != s), s))
        left.remove(q)
        loop = edges[q].pop(q, None)
        through = _star(loop) if loop is not None else EPS
        outgoing = edges.pop(q)
        for bypass in edges.values():
            into = bypass.pop(q, None)
            if into is None:
                continue
            for t, out in outgoing.items():
                bypass[t] = _alt([bypass.get(t), _cat([into, through, out])])
                if len(bypass[t][0]) > _MAX_LENGTH:
                    raise Unregular("the regex would be too long")
    return edges[start].get(end, EPS)


def _group(regex: _Regex) -> str:
    return regex[0] if regex[1] == 2 else f"(?:{regex[0]})"


def _alt(parts: list[_Regex | None]) -> _Regex:
    kept = list(dict.fromkeys(p for p in parts if p is not None))
    optional = EPS in kept
    kept = [p for p in kept if p != EPS]
    if not kept:
        return EPS
    body: _Regex = kept[0] if len(kept) == 1 else ("|".join(p[0] for p in kept), 0)
    return (_group(body) + "?", 2) if optional else body


def _cat(parts: list[_Regex]) -> _Regex:
    kept = [p for p in parts if p != EPS]
    if not kept:
        return EPS
    if len(kept) == 1:
        return kept[0]
    return ("".join(p[0] if p[1] >= 1 else f"(?:{p[0]})" for p in kept), 1)


def _star(regex: _Regex) -> _Regex:
    if regex == EPS:
        return EPS
    text, precedence = regex
    quantified = text.endswith(("?", "*", "}")) and not text.endswith("\\}")
    return (f"{text}*" if precedence == 2 and not quantified else f"(?:{text})*", 2)


def _chars(ranges: Ranges) -> _Regex:
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return (_char(ranges[0][0]), 2)
    if ranges == ((0, MAX_CHAR),):
        return (r"[\s\S]", 2)
    inverse = complement(ranges)
    if len(inverse) < len(ranges):
        return ("[^" + "".join(_range(lo, hi) for lo, hi in inverse) + "]", 2)
    return ("[" + "".join(_range(lo, hi) for lo, hi in ranges) + "]", 2)


def _range(lo: int, hi: int) -> str:
    if lo == hi:
        return _char(lo)
    return f"{_char(lo)}{_char(hi)}" if hi == lo + 1 else f"{_char(lo)}-{_char(hi)}"


def _char(code: int) -> str:
    """One character, escaped so that Python's `re`, ECMA-262 and Rust's regex read it alike."""
    if chr(code).isascii() and chr(code).isalnum():
        return chr(code)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
