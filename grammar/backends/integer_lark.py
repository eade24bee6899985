"""A number-only schema whose numbers are all integers, as an llguidance Lark grammar of the decimal text.

llguidance's JSON compiler has no complement of `multipleOf` (`not`, an
overlapping `oneOf`, `if` over residues). Read as integers (`integer_sets`),
such a schema is a regular language of decimal texts: a digit at a time, the
value is known exactly up to B and by its residue modulo L past it. That
automaton is minimized (Moore's refinement) and written as right-linear rules,
one per state, a digit class each way out and `""` where a number may end.
Texts are JSON integers without a leading zero (`-0` and `1.0` are not
written). Only where the schema allows no other type and rejects every
non-integral number (None otherwise: left to the JSON compiler).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from loraplex.grammar.backends.string_lark import Untranslatable
from loraplex.grammar.schema.integer_sets import integer_terms, judge, rejects_fractions
from loraplex.grammar.schema.walk import conjuncts

_MAX_STATES = 60_000   # of the automaton before it is minimized
_MAX_RULES = 1024      # of the grammar written (llguidance 1.9 crashed on 3000 such rules, took 2000)
_MINUS = 10            # symbols: the digits 0-9, then `-`
_DEAD, _START, _SIGNED, _ZERO = 0, 1, 2, 3


def integer_lark(schema: Any) -> str | None:
    """A Lark grammar for a schema of the kind above; None otherwise."""
    parts = conjuncts(schema, schema) if isinstance(schema, dict) else None
    if not parts or not any(_only_numbers(part.get("type")) for part in parts):
        return None
    try:
        terms = integer_terms(schema, schema)
        if 4 + 2 * (terms.bound + terms.modulus) > _MAX_STATES or not rejects_fractions(schema, schema, terms):
            return None
        moves, accepting = _automaton(schema, terms.bound, terms.modulus)
        return _rules(*_minimized(moves, accepting))
    except Untranslatable:
        return None


def _only_numbers(value: Any) -> bool:
    names = value if isinstance(value, list) else [value]
    return bool(names) and all(name in ("integer", "number") for name in names)


def _automaton(schema: Any, bound: int, modulus: int) -> tuple[np.ndarray, np.ndarray]:
    """States: dead, start, after `-`, after `0`; per sign, the exact values 1..B, then the residues past B."""
    exact = [4, 4 + bound]                          # first exact state per sign (+, -)
    residue = [4 + 2 * bound, 4 + 2 * bound + modulus]
    num_states = 4 + 2 * (bound + modulus)
    moves = np.zeros((num_states, 11), dtype=np.int64)
    accepting = np.zeros(num_states, dtype=bool)
    digits = np.arange(10)
    values = np.arange(1, bound + 1)
    past = bound + 1 + (np.arange(modulus) - (bound + 1)) % modulus  # the least value past B of each residue
    for sign in (0, 1):
        def state_of(value: np.ndarray, sign: int = sign) -> np.ndarray:
            return np.where(value <= bound, exact[sign] + value - 1, residue[sign] + value % modulus)

        opened = state_of(digits[1:])
        moves[_START if sign == 0 else _SIGNED, 1:10] = opened
        moves[exact[sign]:exact[sign] + bound, :10] = state_of(values[:, None] * 10 + digits[None, :])
        moves[residue[sign]:residue[sign] + modulus, :10] = (
            residue[sign] + (np.arange(modulus)[:, None] * 10 + digits[None, :]) % modulus)
        factor = -1 if sign else 1
        accepting[exact[sign]:exact[sign] + bound] = judge(schema, schema, factor * values)
        accepting[residue[sign]:residue[sign] + modulus] = judge(schema, schema, factor * past)
    moves[_START, 0] = _ZERO
    moves[_START, _MINUS] = _SIGNED
    accepting[_ZERO] = judge(schema, schema, np.zeros(1, dtype=np.int64))[0]
    return moves, accepting


def _minimized(moves: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(moves, accepting) between the classes of equivalent states, the start's class and the dead one's."""
    classes = accepting.astype(np.int64)
    count = len(np.unique(classes))
    while True:
        signature = np.concatenate([classes[:, None], classes[moves]], axis=1)
        _, refined = np.unique(signature, axis=0, return_inverse=True)
        refined = refined.reshape(-1)
        if len(np.unique(refined)) == count:
            break
        classes, count = refined, len(np.unique(refined))
    firsts = np.unique(classes, return_index=True)[1]
    return classes[moves[firsts]], accepting[firsts], int(classes[_START]), int(classes[_DEAD])


def _rules(moves: np.ndarray, accepting: np.ndarray, start: int, dead: int) -> str | None:
    if start == dead:
        return None
    reached, wanted = {start}, [start]
    while wanted:
        for target in moves[wanted.pop()]:
            if int(target) != dead and int(target) not in reached:
                reached.add(int(target))
                wanted.append(int(target))
    if len(reached) > _MAX_RULES:
        raise Untranslatable
    lines = [f"start: n{start}"]
    for state in sorted(reached):
        targets: dict[tuple[int, bool], list[int]] = {}
        for symbol, target in enumerate(moves[state]):
            if int(target) != dead:
                targets.setdefault((int(target), symbol == _MINUS), []).append(symbol)
        alternatives = ['""'] if accepting[state] else []
        alternatives += [f"{_symbols(symbols)} n{target}" for (target, _), symbols in targets.items()]
        lines.append(f"n{state}: {' | '.join(alternatives)}")
    return "\n".join(lines) + "\n"


def _symbols(symbols: list[int]) -> str:
    if symbols == [_MINUS]:
        return '"-"'
    if len(symbols) == 1:
        return f'"{symbols[0]}"'
    runs: list[str] = []
    for symbol in symbols:
        if runs and runs[-1][-1] == str(symbol - 1):
            runs[-1] = runs[-1][0] + str(symbol)
        else:
            runs.append(str(symbol))
    return "/[" + "".join(run if len(run) == 1 else f"{run[0]}-{run[1]}" for run in runs) + "]/"
