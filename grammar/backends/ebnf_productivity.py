"""Rules of an EBNF grammar that can never finish: found before the grammar is compiled.

A rule is productive when some way through it ends: a literal or character
class, a sequence of productive parts, any productive alternative, a
repetition that may be empty or repeats something productive. The productive
rules are the least fixpoint of that, and a rule reachable from `root` outside
it (`root ::= "x" root`) can never finish. Such a grammar is refused: its
matcher would force text on without end, and xgrammar's jump-forward (the
longest forced string) never returns on it, which stalled whatever process
built the matcher, the engine included.

Parsed with llguidance's GBNF reader; a grammar it cannot read (a dialect
feature it lacks) is not judged here (None), and goes on to the backend.
"""

from __future__ import annotations

from llguidance.gbnf_to_lark import (
    AlternativeNode,
    ASTNode,
    GbnfToLarkError,
    GrammarParser,
    LiteralNode,
    RegexNode,
    RepetitionNode,
    RuleNode,
    RuleRefNode,
    SequenceNode,
)

ROOT = "root"


def unfinishable_rules(text: str) -> list[str] | None:
    """The rules reachable from `root` that no finite text completes, in order of appearance; None when the
    grammar cannot be read here."""
    try:
        rules = GrammarParser().parse(text)
    except (GbnfToLarkError, ValueError, KeyError, IndexError, RecursionError):
        return None
    if ROOT not in rules or any(ref not in rules for rule in rules.values() for ref in _references(rule.alternatives)):
        return None  # the backend names what is missing
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, rule in rules.items():
            if name not in productive and _ends(rule.alternatives, productive):
                productive.add(name)
                changed = True
    return [name for name in _reachable(rules) if name not in productive]


def _ends(node: ASTNode, productive: set[str]) -> bool:
    if isinstance(node, (LiteralNode, RegexNode)):
        return True
    if isinstance(node, RuleRefNode):
        return node.name in productive
    if isinstance(node, RepetitionNode):
        return node.min_times == 0 or _ends(node.node, productive)
    if isinstance(node, SequenceNode):
        return all(_ends(part, productive) for part in node.nodes)
    if isinstance(node, AlternativeNode):
        return any(_ends(part, productive) for part in node.alternatives)
    return True  # a node kind not known here: no proof that it cannot end


def _reachable(rules: dict[str, RuleNode]) -> list[str]:
    seen: list[str] = []
    pending = [ROOT]
    while pending:
        name = pending.pop()
        if name in seen or name not in rules:
            continue
        seen.append(name)
        pending.extend(_references(rules[name].alternatives))
    return seen


def _references(node: ASTNode) -> list[str]:
    found: list[str] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, RuleRefNode):
            found.append(current.name)
        stack.extend(current.children())
    return found
