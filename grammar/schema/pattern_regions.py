"""Overlapping `patternProperties`, written as disjoint ones: one pattern per region of the keys.

A key that matches several patterns owes its value to each of their
subschemas. llguidance's JSON compiler wants the patterns of an object
disjoint, so patterns that overlap are replaced by the regions they cut the
keys into (matching exactly the patterns of a set and none of the others,
`regular_dfa.patterns_region`), each owing the `allOf` of that set's
subschemas; the union of the regions is the union of the patterns, so
`additionalProperties` covers the same keys. A region is read as ECMA-262
reads the patterns; patterns using a class that readers dispute (`.`,
`\\d`, `\\w`, `\\s`), too many to split, or regions too long to write
are left as they are.
"""

from __future__ import annotations

import copy
from itertools import combinations
from typing import Any

from loraplex.grammar.schema.connectives import all_of
from loraplex.grammar.schema.regular import Unregular
from loraplex.grammar.schema.regular_dfa import patterns_region
from loraplex.grammar.schema.walk import subschemas

_MAX_PATTERNS = 4  # 2 ** 4 - 1 regions at most
# Longer regions are left unsplit: llguidance proves the patterns of an object disjoint again, within a budget
# that long ones run out of (and the object grammars' own reading of overlapping patterns handles them)
_MAX_REGION = 256


def disjoint_pattern_properties(patterns: Any) -> dict[str, Any] | None:
    """`patterns` (a patternProperties map) as disjoint regions; None when they do not overlap or cannot
    be split here."""
    if not isinstance(patterns, dict) or not 2 <= len(patterns) <= _MAX_PATTERNS:
        return None
    keys = list(patterns)
    try:
        if all(patterns_region([a, b], [], exact=True) is None for a, b in combinations(keys, 2)):
            return None
        regions: dict[str, Any] = {}
        for size in range(1, len(keys) + 1):
            for chosen in combinations(range(len(keys)), size):
                region = patterns_region([keys[i] for i in chosen],
                                         [k for i, k in enumerate(keys) if i not in chosen], exact=True)
                if region is not None and len(region) > _MAX_REGION:
                    return None
                if region is not None:
                    regions[region] = all_of([patterns[keys[i]] for i in chosen])
    except Unregular:
        return None
    return regions


def with_disjoint_pattern_properties(schema: Any) -> Any:
    """`schema` (a copy when anything changes) with each overlapping patternProperties written disjoint."""
    if not any(isinstance(node, dict) and disjoint_pattern_properties(node.get("patternProperties"))
               for _, node, _ in subschemas(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, node, _ in list(subschemas(schema)):
        if isinstance(node, dict) and (split := disjoint_pattern_properties(node.get("patternProperties"))):
            node["patternProperties"] = split
    return schema
