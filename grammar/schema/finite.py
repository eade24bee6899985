"""A subschema whose values come from a finite set, written as the `enum` of the values that validate.

`{"allOf": [{"enum": [1, 2, 3]}, {"not": {"minimum": 2}}]}` accepts a subset of
`[1, 2, 3]` whatever its other keywords say: the ones a JSON-schema validator
(`jsonschema`) accepts against the whole subschema. That subset, as an `enum`,
is the same language, for any keyword the validator knows (`not`, `if`,
`multipleOf`, `uniqueItems`, ...), and every backend enforces an `enum`.

The finite set comes from an `enum`/`const` of the subschema itself, of one of
its `allOf` members, or of every branch of its `anyOf`/`oneOf` (local `$ref`s
followed); an array of bounded length (`maxItems`, or `uniqueItems`) whose
items come from such a set is one too: every sequence of them, so
`uniqueItems` or `contains` over a few enum values becomes the `enum` of the
arrays they allow. A schema that names no draft is checked against both draft 7 and
2020-12 (a value kept is valid whichever the author meant).
"""

from __future__ import annotations

from itertools import permutations, product
from math import perm
from typing import Any, TypeGuard

import jsonschema
import referencing
from loraplex.grammar.schema.metaschema import check_schema
from loraplex.grammar.schema.walk import VALIDATION_KEYWORDS, resolve_ref

_MAX_VALUES = 512
_MAX_DEPTH = 8
_TRIVIAL = frozenset({"enum", "const", "type", "$ref"})  # a subschema of only these has nothing to filter
_MAX_CHECKS = 2048  # values validated per schema, in all: the compile-time budget of this rewrite
_MAX_ARRAYS = 128  # arrays of a finite item set enumerated for one subschema


class FiniteValues:
    """Validators over one root schema; `filtered(node)` for any of its subschemas."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._validators: list[Any] | None = None
        self._num_checks = 0

    def filtered(self, node: Any) -> list[Any] | None:
        """The values of `node`'s finite set that `node` accepts; None when it has no finite set (or is one)."""
        if not isinstance(node, dict) or not (set(node) & VALIDATION_KEYWORDS) - _TRIVIAL:
            return None
        values = self._candidates(node, 0)
        if values is None or self._num_checks + len(values) > _MAX_CHECKS:
            return None
        self._num_checks += len(values)
        validators = self._get_validators()
        if not validators:
            return None
        kept: list[Any] = []
        try:
            checks = [v.evolve(schema=node) for v in validators]
            for value in values:
                if all(check.is_valid(value) for check in checks) and not _contains(kept, value):
                    kept.append(value)
        except JUDGING_ERRORS:
            return None
        return kept

    def _get_validators(self) -> list[Any]:
        if self._validators is None:
            self._validators = offline_validators(self.root)
        return self._validators

    def _candidates(self, node: Any, depth: int) -> list[Any] | None:
        if depth > _MAX_DEPTH or not isinstance(node, dict):
            return None
        if "const" in node:
            return [node["const"]]
        if isinstance(node.get("enum"), list):
            return node["enum"] if len(node["enum"]) <= _MAX_VALUES else None
        if "$ref" in node:
            found = self._candidates(resolve_ref(node["$ref"], self.root), depth + 1)
            if found is not None:
                return found
        for member in node.get("allOf") or []:
            found = self._candidates(member, depth + 1)
            if found is not None:
                return found
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                union: list[Any] = []
                for branch in branches:
                    found = self._candidates(branch, depth + 1)
                    if found is None:
                        break
                    union += found
                else:
                    return union if len(union) <= _MAX_VALUES else None
        return self._arrays(node, depth)

    def _arrays(self, node: dict, depth: int) -> list[Any] | None:
        """An array-only subschema whose items come from a finite set and whose length is bounded (`maxItems`,
        or `uniqueItems`: no more items than values) has finitely many instances: every such sequence."""
        if node.get("type") not in ("array", ["array"]) or "prefixItems" in node or isinstance(node.get("items"), list):
            return None
        items = self._candidates(node.get("items"), depth + 1) if isinstance(node.get("items"), dict) else None
        if items is None:
            return None
        distinct: list[Any] = []
        for value in items:
            if not _contains(distinct, value):
                distinct.append(value)
        unique = node.get("uniqueItems") is True
        low, high = node.get("minItems", 0), node.get("maxItems", len(distinct) if unique else None)
        if not _count(low) or not _count(high):
            return None
        high = min(high, len(distinct)) if unique else high
        sizes = range(low, high + 1)
        total = sum(perm(len(distinct), k) if unique else len(distinct) ** k for k in sizes)
        if total > _MAX_ARRAYS:
            return None
        make = permutations if unique else (lambda values, k: product(values, repeat=k))
        return [list(sequence) for k in sizes for sequence in make(distinct, k)]


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _contains(values: list[Any], value: Any) -> bool:
    """JSON equality (1 == 1.0, but true != 1)."""
    return any(type(v) is type(value) or (_number(v) and _number(value)) for v in values if v == value)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# What judging a value against a schema the passes rewrote may raise: the schema (or a $ref in it) turned out
# invalid or too deep, or a format checker choked on the value. Either way the pass gives up, never guesses.
JUDGING_ERRORS = (jsonschema.SchemaError, referencing.exceptions.Unresolvable, RecursionError, ValueError,
                  TypeError, KeyError, AttributeError)


def offline_validators(root: Any) -> list[Any]:
    """jsonschema validators for `root`: its declared draft, else draft 7 and 2020-12 (a value must satisfy
    both to count); none when `root` is not a valid schema. An empty registry: a remote $ref is unresolvable
    here, never fetched."""
    declared = isinstance(root, dict) and "$schema" in root
    classes = ([jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)]
               if declared else [jsonschema.Draft7Validator, jsonschema.Draft202012Validator])
    validators = []
    for cls in classes:
        try:
            check_schema(cls, root)
        except (jsonschema.SchemaError, referencing.exceptions.Unresolvable, RecursionError):
            return []
        validators.append(cls(root, format_checker=cls.FORMAT_CHECKER, registry=referencing.Registry()))
    return validators
