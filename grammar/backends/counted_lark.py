"""Elements one after another as Lark rules, counted, with the "some element meets X" still unmet.

array_lark (items, some meeting each `contains`) and object_lark (members,
some meeting each required key or pattern) write the same automaton, so it
is written once here. A state is (elements read, counted only as far as a
bound needs; the bit set of the constraints no element has met yet). An
element of kind `met` meets the constraints in `met` and is read by its own
rule (None when no value is of that kind); the closing bracket comes once
enough were read and none is left. Only states from which the closing
bracket can still be reached are written.
"""

from __future__ import annotations

State = tuple[int, int]  # (elements read, constraints left)


def num_states(low: int, high: int | None, num_exists: int) -> int:
    """How many states the automaton may have, to check before the kinds' rules are written."""
    return (_cap(low, high) + 1) << num_exists


def counted_rules(kinds: dict[int, str | None], low: int, high: int | None, *, prefix: str, brackets: tuple[str, str],
                  only_unmet: bool) -> tuple[list[str], list[str]]:
    """The rules `{prefix}_{read}_{left}` of the states after the opening bracket, and the alternatives that
    open the sequence (none when it can never close). `kinds` holds a rule for every bit set of the
    constraints, from 0 to all of them. `only_unmet`: an element counts as meeting only constraints still
    unmet (object_lark); without it every kind stays open in every state (array_lark), which says the same
    sequences with more alternatives."""
    opening, closing_bracket = brackets  # `[`, `]` or `{`, `}`
    everything = len(kinds) - 1
    cap = _cap(low, high)
    start = (0, everything)
    moves: dict[State, list[tuple[str, State]]] = {}
    wanted = [start]
    while wanted:
        state = wanted.pop()
        if state in moves:
            continue
        read, left = state
        moves[state] = [] if high is not None and read >= high else [
            (rule, (min(read + 1, cap), left & ~met)) for met, rule in kinds.items()
            if rule is not None and (not only_unmet or met & ~left == 0)]
        wanted += [target for _, target in moves[state]]
    closing = {state for state in moves if state[0] >= low and not state[1]}
    live = set(closing)
    while True:  # the states from which the closing bracket can still be reached
        grown = live | {state for state, out in moves.items() if any(target in live for _, target in out)}
        if grown == live:
            break
        live = grown
    if start not in live:
        return [], []

    def name(state: State) -> str:
        return f"{prefix}_{state[0]}_{state[1]}"

    rules = []
    for state in sorted(live - {start}):
        alternatives = [f'"{closing_bracket}"'] if state in closing else []
        alternatives += [f'", " {rule} {name(target)}' for rule, target in moves[state] if target in live]
        rules.append(f"{name(state)}: {' | '.join(alternatives)}")
    openings = [f'"{opening}{closing_bracket}"'] if start in closing else []
    openings += [f'"{opening}" {rule} {name(target)}' for rule, target in moves[start] if target in live]
    return rules, openings


def _cap(low: int, high: int | None) -> int:
    """Read counts past this one are alike: the bound, or without one `low` (at least 1; 0 is the start)."""
    return high if high is not None else max(low, 1)
