"""Checking a tenant's schema against its draft's metaschema in time linear in its size.

jsonschema's own `check_schema` tests `uniqueItems` (draft 4's `enum`, every
draft's `required` and `type` arrays) by sorting the items, and falls back to
comparing every pair when they cannot be sorted: a draft-4 `enum` of 40,000
numbers and one string (about 240 KB) took minutes of CPU. Here `uniqueItems`
compares hashable keys of the items instead, with JSON's equality (1 == 1.0,
true != 1, objects whatever their key order). The values' nesting is bounded
before this runs (walk.value_nesting_problem), so the keys' recursion is too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

_CHECKERS: dict[Any, Any] = {}


def check_schema(validator_class: Any, schema: Any) -> None:
    """Raise jsonschema.SchemaError if `schema` is not valid under `validator_class`'s metaschema."""
    meta_class = _CHECKERS.get(validator_class)
    if meta_class is None:
        own = jsonschema.validators.validator_for(validator_class.META_SCHEMA, default=validator_class)
        meta_class = _CHECKERS[validator_class] = jsonschema.validators.extend(own, {"uniqueItems": _unique_items})
    checker = meta_class(validator_class.META_SCHEMA, format_checker=meta_class.FORMAT_CHECKER)
    for error in checker.iter_errors(schema):
        raise jsonschema.SchemaError.create_from(error)


def json_key(value: Any) -> Any:
    """A hashable key equal for two JSON values exactly when JSON says they are equal."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)  # 1 and 1.0 hash and compare equal
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("l", tuple(json_key(item) for item in value))
    if isinstance(value, dict):
        return ("d", frozenset((name, json_key(item)) for name, item in value.items()))
    return ("z", None)


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        key = json_key(item)
        if key in seen:
            yield ValidationError(f"{instance!r:.200} has non-unique elements")
            return
        seen.add(key)
