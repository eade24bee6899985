"""Schemas in disjunctive form: how `allOf`, `anyOf` and `$ref` combine clauses, for any kind of clause.

array_lark and object_lark read a schema node as a list of clauses, each a
conjunction of what the node asks (of an array's items, of an object's
members). What a clause holds is theirs; how the connectives combine clauses
is the same for both, so it is written once here: `allOf` is the product of
its members' clauses (each pair merged into one), `anyOf` their
concatenation, `$ref` its target's. Each step is capped (`most`), so that a
schema cannot multiply into more clauses than a grammar can hold.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import product
from typing import Any, Protocol, Self, TypeVar

from loraplex.grammar.backends.string_lark import Untranslatable
from loraplex.grammar.schema.walk import resolve_ref


class Clause(Protocol):
    def merged(self, other: Self) -> Self:
        """The conjunction of both clauses."""
        ...


C = TypeVar("C", bound=Clause)


def clause_product(left: list[C], right: list[C], most: int) -> list[C]:
    """`left` and `right` both hold: every clause of one merged with every clause of the other."""
    if len(left) * len(right) > most:
        raise Untranslatable
    return [a.merged(b) for a, b in product(left, right)]


def connective_clauses(key: str, value: Any, *, root: dict[str, Any], read: Callable[[Any], list[C]],
                       new: Callable[[], C], most: int) -> list[C] | None:
    """The clauses of a `$ref`, `allOf` or `anyOf` keyword, each schema it names read by `read`; None for any
    other keyword. `new` makes the clause that asks nothing."""
    if key == "$ref":
        target = resolve_ref(value, root)
        if target is None:
            raise Untranslatable
        return read(target)
    if key == "allOf" and isinstance(value, list):
        result = [new()]
        for member in value:
            result = clause_product(result, read(member), most)
        return result
    if key == "anyOf" and isinstance(value, list):
        result = [c for member in value for c in read(member)]
        if len(result) > most:
            raise Untranslatable
        return result
    return None
