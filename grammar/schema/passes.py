"""The schema passes, in the one order they run: from a request's JSON schema to what a backend compiles.

Each pass keeps the schema's language exactly (an identity of JSON Schema,
or a check moved to the matchers) and writes it in words the backends
enforce. `SCHEMA_PASSES` is the whole list; nothing else rewrites a schema
before it is compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from loraplex.grammar.schema.anchors import with_inner_end_anchors_resolved
from loraplex.grammar.schema.formats import with_formats_enforced
from loraplex.grammar.schema.identities import with_exact_identities
from loraplex.grammar.schema.lookaheads import with_lookaheads_resolved
from loraplex.grammar.schema.one_of_disjoint import with_disjoint_one_of_as_any_of
from loraplex.grammar.schema.pattern_regions import with_disjoint_pattern_properties
from loraplex.grammar.schema.patterns import with_unmatchable_patterns_as_no_string
from loraplex.grammar.schema.productive import with_unproductive_as_false
from loraplex.grammar.schema.refs import (
    with_boolean_refs_inlined,
    with_reachable_ref_targets,
    without_ignored_ref_siblings,
)
from loraplex.grammar.schema.unique_items import UniqueItemsPlan, without_checked_unique_items


@dataclass(frozen=True, slots=True)
class PreparedSchema:
    schema: Any                                  # what the backend compiles; False when it accepts nothing
    unique_items: UniqueItemsPlan | None = None  # uniqueItems checked by the matchers instead of the grammar


SchemaPass = Callable[[PreparedSchema], PreparedSchema]


def _on_schema(rewrite: Callable[[Any], Any]) -> SchemaPass:
    def run(prepared: PreparedSchema) -> PreparedSchema:
        return replace(prepared, schema=rewrite(prepared.schema))

    run.__name__ = rewrite.__name__
    return run


def _unique_items_to_matchers(prepared: PreparedSchema) -> PreparedSchema:
    schema, plan = without_checked_unique_items(prepared.schema)
    return PreparedSchema(schema, plan)


SCHEMA_PASSES: tuple[SchemaPass, ...] = (
    # every $ref target where the passes below can see it
    _on_schema(with_reachable_ref_targets),
    # up to draft 7 a $ref overrides its siblings: they go
    _on_schema(without_ignored_ref_siblings),
    # a subschema whose every value would hold another without end (a required self-reference) accepts nothing
    _on_schema(with_unproductive_as_false),
    # annotation formats dropped, the ones with an exact pattern written as it
    _on_schema(with_formats_enforced),
    # a pattern no string matches (anchors inside it) admits no string
    _on_schema(with_unmatchable_patterns_as_no_string),
    # a `$` inside a pattern (`^(a($|/))*$`) written as the same language without it
    _on_schema(with_inner_end_anchors_resolved),
    # a lookahead (`(?!.*--)`) written as the plain regex of the same strings
    _on_schema(with_lookaheads_resolved),
    # oneOf over provably disjoint branches is anyOf
    _on_schema(with_disjoint_one_of_as_any_of),
    # not, if/then/else, dependencies, property counts and names, overlapping oneOf; finite sets as enums
    _on_schema(with_exact_identities),
    # overlapping patternProperties as disjoint regions of the keys, each owing its patterns' subschemas
    _on_schema(with_disjoint_pattern_properties),
    # a $ref to a subschema that became true/false is that boolean
    _on_schema(with_boolean_refs_inlined),
    # uniqueItems over strings: checked by the matchers, the grammar goes without
    _unique_items_to_matchers,
)


def prepare_schema(schema: Any) -> PreparedSchema:
    """`schema` through every pass in order (the input is left alone)."""
    prepared = PreparedSchema(schema)
    for schema_pass in SCHEMA_PASSES:
        prepared = schema_pass(prepared)
        if prepared.schema is False:
            return PreparedSchema(False)
    return prepared
