"""Which numbers a number-only schema accepts, read as sets of integers: exact below a bound, by residue above.

A schema whose number keywords are `multipleOf` (integers), bounds, `enum`
and `const`, under `allOf`/`anyOf`/`oneOf`/`not`/`if`/`$ref`, decides an
integer v by v itself up to B (the largest bound or listed value) and, past
B, by v's sign and its residue modulo L (the lcm of the `multipleOf`s): every
integer past B of one sign and residue meets the same keywords. `judge`
evaluates the schema as JSON Schema does, on whole arrays of values at once;
keywords of other types never fail a number. A non-integral number fails
every integer `multipleOf`, so between two listed points it is decided
alike: `rejects_fractions` tries one in each gap and the points themselves.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeGuard

import numpy as np
from loraplex.grammar.backends.string_lark import Untranslatable
from loraplex.grammar.schema.walk import resolve_ref

MAX_BOUND = 100_000     # B: integers decided one by one
MAX_MODULUS = 100_000   # L: residues decided one by one
_MAX_DEPTH = 32
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_CONNECTIVES = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref")
_REFUSED = ("$dynamicRef", "$recursiveRef")


@dataclass(frozen=True, slots=True)
class IntegerTerms:
    bound: int                 # B: every bound and listed value lies within [-B, B]
    modulus: int               # L
    points: tuple[Fraction, ...]  # every bound and listed number


def integer_terms(schema: Any, root: Any) -> IntegerTerms:
    """B, L and the listed points of `schema`; Untranslatable where a keyword is not one of the above."""
    modulus, points = 1, set()
    for node in _nodes(schema, root):
        for key in _BOUNDS:
            value = node.get(key)
            if _is_number(value):
                points.add(Fraction(value))
            elif value is not None and not isinstance(value, bool):
                raise Untranslatable
        listed = [node["const"]] if "const" in node else node.get("enum", [])
        if not isinstance(listed, list):
            raise Untranslatable
        points.update(Fraction(v) for v in listed if _is_number(v))
        if "multipleOf" in node:
            step = node["multipleOf"]
            if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
                raise Untranslatable  # a fractional step: jsonschema's own float arithmetic decides it
            modulus = math.lcm(modulus, step)
        if any(key in node for key in _REFUSED):
            raise Untranslatable
    bound = max((math.ceil(abs(p)) for p in points), default=0)
    if bound > MAX_BOUND or modulus > MAX_MODULUS:
        raise Untranslatable
    return IntegerTerms(bound, modulus, tuple(sorted(points)))


def judge(schema: Any, root: Any, values: np.ndarray, depth: int = 0) -> np.ndarray:
    """Which of `values` (integers, or floats standing for non-integral numbers) `schema` accepts."""
    if depth > _MAX_DEPTH:
        raise Untranslatable
    if schema is True or schema is False:
        return np.full(values.shape, schema)
    if not isinstance(schema, dict):
        raise Untranslatable
    ok = np.ones(values.shape, dtype=bool)
    integral = np.floor(values) == values
    for key, value in schema.items():
        if key == "type":
            names = value if isinstance(value, list) else [value]
            ok &= integral if "number" not in names and "integer" in names else np.full(values.shape, "number" in names)
        elif key in ("enum", "const"):
            listed = [v for v in ([value] if key == "const" else value) if _is_number(v)]
            ok &= np.isin(values, np.array(listed, dtype=np.float64)) if listed else False
        elif key == "multipleOf":
            ok &= integral & (np.mod(values, value) == 0)
        elif key in _BOUNDS and not isinstance(value, bool):
            ok &= _bounded(key, value, schema, values)
        elif key == "allOf":
            for member in value:
                ok &= judge(member, root, values, depth + 1)
        elif key == "anyOf":
            ok &= np.logical_or.reduce([judge(m, root, values, depth + 1) for m in value])
        elif key == "oneOf":
            ok &= np.sum([judge(m, root, values, depth + 1) for m in value], axis=0) == 1
        elif key == "not":
            ok &= ~judge(value, root, values, depth + 1)
        elif key == "if":
            met = judge(value, root, values, depth + 1)
            ok &= np.where(met, judge(schema.get("then", True), root, values, depth + 1),
                           judge(schema.get("else", True), root, values, depth + 1))
        elif key == "$ref":
            target = resolve_ref(value, root)
            if target is None:
                raise Untranslatable
            ok &= judge(target, root, values, depth + 1)
    return ok


def rejects_fractions(schema: Any, root: Any, terms: IntegerTerms) -> bool:
    """Whether `schema` rejects every non-integral number (one tried at each listed point and in each gap)."""
    points = sorted({float(p) for p in terms.points} | {0.0})
    tried = [points[0] - 0.5, points[-1] + 0.5, *(p for p in points if not p.is_integer())]
    for low, high in itertools.pairwise(points):
        middle = (low + high) / 2
        tried.append(middle if not middle.is_integer() else low + (high - low) / 4)
    tried = [t for t in tried if not t.is_integer()]
    return not judge(schema, root, np.array(tried, dtype=np.float64)).any()


def _bounded(key: str, value: Any, schema: dict, values: np.ndarray) -> np.ndarray:
    exclusive = key.startswith("exclusive") or schema.get("exclusive" + key.title()) is True  # draft 4's Boolean
    if key in ("minimum", "exclusiveMinimum"):
        return values > value if exclusive else values >= value
    return values < value if exclusive else values <= value


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _nodes(schema: Any, root: Any) -> list[dict]:
    """Every subschema reached through the connectives (each once), which alone decide a number."""
    out: list[dict] = []
    seen: set[int] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise Untranslatable
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        for key in _CONNECTIVES:
            value = node.get(key)
            if key == "$ref" and value is not None:
                target = resolve_ref(value, root)
                if target is None:
                    raise Untranslatable
                stack.append(target)
            elif isinstance(value, list):
                stack.extend(value)
            elif value is not None and key != "$ref":
                stack.append(value)
        if len(out) > 4096:
            raise Untranslatable
    return out
