"""Regexes from an uploaded adapter_config.json are checked before they are ever matched.

PEFT lets `target_modules` / `exclude_modules` be one regex and the keys of
`rank_pattern` / `alpha_pattern` be regexes; we match them against module
names in the validation task and when an adapter is loaded. Python's `re`
backtracks, so a pattern such as `(a+)+$` or `(.*)*x` can take exponential
time. Rather than time out a match, a pattern is refused when its parsed form
can backtrack badly: a repeat inside a repeat, an alternation inside a
repeat, a back-reference, or more unbounded repeats than a module-name
pattern needs (each adds a polynomial factor).
"""

from __future__ import annotations

import re
from re import _constants as sre_constants  # type: ignore[attr-defined]
from re import _parser as sre_parser  # type: ignore[attr-defined]

from loraplex.adapters.errors import AdapterRejectedError

MAX_PATTERN_LENGTH = 256
MAX_UNBOUNDED_REPEATS = 3  # `.*decoder.*(q|v)_proj.*` needs three

_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT)
_BACKREFERENCES = (sre_constants.GROUPREF, sre_constants.GROUPREF_EXISTS)


def check_safe_regex(pattern: str, field: str, *, max_unbounded: int = MAX_UNBOUNDED_REPEATS) -> None:
    """Raise AdapterRejectedError (naming `field`) unless `pattern` compiles and cannot backtrack badly."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise AdapterRejectedError(f"{field} regex is {len(pattern)} characters long (at most {MAX_PATTERN_LENGTH})")
    try:
        parsed = sre_parser.parse(pattern)
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as exc:
        raise AdapterRejectedError(f"{field} regex {pattern!r} does not compile: {exc}") from None
    num_unbounded = _walk(parsed, field, pattern, inside_repeat=False)
    if num_unbounded > max_unbounded:
        raise AdapterRejectedError(
            f"{field} regex {pattern!r} has {num_unbounded} unbounded repeats (at most {max_unbounded})"
        )


def _walk(items: object, field: str, pattern: str, *, inside_repeat: bool) -> int:
    """Walk a parsed pattern; return how many unbounded repeats it holds, raising on a dangerous shape."""
    num_unbounded = 0
    for op, av in items:  # type: ignore[attr-defined]
        if op in _REPEATS:
            _low, high, body = av
            repeats = high == sre_constants.MAXREPEAT or high > 1
            if repeats and inside_repeat:
                raise AdapterRejectedError(f"{field} regex {pattern!r} nests repeats (catastrophic backtracking)")
            num_unbounded += high == sre_constants.MAXREPEAT
            num_unbounded += _walk(body, field, pattern, inside_repeat=inside_repeat or repeats)
        elif op is sre_constants.BRANCH:
            if inside_repeat:
                raise AdapterRejectedError(f"{field} regex {pattern!r} repeats an alternation (catastrophic "
                                           "backtracking)")
            for branch in av[1]:
                num_unbounded += _walk(branch, field, pattern, inside_repeat=inside_repeat)
        elif op is sre_constants.SUBPATTERN:
            num_unbounded += _walk(av[3], field, pattern, inside_repeat=inside_repeat)
        elif op in _BACKREFERENCES:
            raise AdapterRejectedError(f"{field} regex {pattern!r} uses a back-reference")
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            num_unbounded += _walk(av[1], field, pattern, inside_repeat=inside_repeat)
        elif op in (sre_constants.ATOMIC_GROUP,):
            num_unbounded += _walk(av, field, pattern, inside_repeat=inside_repeat)
        elif op is sre_constants.POSSESSIVE_REPEAT:
            num_unbounded += _walk(av[2], field, pattern, inside_repeat=inside_repeat)
    return num_unbounded
