"""The schema passes: one declared list, in order, each pass and each subschema rewrite on its own.

Every rewrite must keep the language: each test checks the rewritten schema
against the original with `jsonschema` over a few values, besides what the
rewrite should have written.
"""

from __future__ import annotations

import jsonschema
import pytest
from loraplex.grammar.schema.formats import FORMAT_PATTERNS, with_formats_enforced
from loraplex.grammar.schema.identities import NODE_REWRITES, with_exact_identities
from loraplex.grammar.schema.object_keys import (
    at_least_one_property,
    closed_property_count,
    dependencies,
    forbidden_required_key,
    property_count_by_presence,
    property_names,
)
from loraplex.grammar.schema.one_of_disjoint import with_disjoint_one_of_as_any_of
from loraplex.grammar.schema.passes import SCHEMA_PASSES, prepare_schema
from loraplex.grammar.schema.patterns import never_matches, with_unmatchable_patterns_as_no_string
from loraplex.grammar.schema.refs import (
    with_boolean_refs_inlined,
    with_reachable_ref_targets,
    without_ignored_ref_siblings,
)
from loraplex.grammar.schema.unique_items import without_checked_unique_items

VALUES = [None, True, 0, 3, 7.5, "", "a", "abc", [], ["a"], ["a", "a"], ["a", "b"], [1, 2], {}, {"a": 1},
          {"b": 2}, {"a": 1, "b": 2}, {"a": "x", "c": 3}, {"a": 1, "b": 2, "c": 3}, {"c": None}]


def same_language(a, b, draft=jsonschema.Draft7Validator) -> bool:
    return all(draft(a).is_valid(v) == draft(b).is_valid(v) for v in VALUES)


def test_the_passes_run_in_one_declared_order():
    assert [p.__name__ for p in SCHEMA_PASSES] == [
        "with_reachable_ref_targets", "without_ignored_ref_siblings", "with_unproductive_as_false",
        "with_formats_enforced",
        "with_unmatchable_patterns_as_no_string", "with_inner_end_anchors_resolved",
        "with_lookaheads_resolved", "with_disjoint_one_of_as_any_of", "with_exact_identities",
        "with_disjoint_pattern_properties", "with_boolean_refs_inlined",
        "_unique_items_to_matchers",
    ]


def test_prepare_schema_runs_every_pass_and_leaves_the_input_alone():
    schema = {"type": "object", "properties": {"t": {"type": "string", "format": "json-pointer"},
                                               "tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True},
                                               "n": {"not": {"type": "string"}}}}
    before = repr(schema)
    prepared = prepare_schema(schema)
    properties = prepared.schema["properties"]
    assert properties["t"]["pattern"] == FORMAT_PATTERNS["json-pointer"]
    assert "uniqueItems" not in properties["tags"] and prepared.unique_items is not None
    assert "not" not in properties["n"]
    assert repr(schema) == before


def test_prepare_schema_of_a_contradiction_is_false():
    assert prepare_schema({"allOf": [{"const": 1}, {"not": {"const": 1}}]}).schema is False


def test_reachable_ref_targets():
    schema = {"$ref": "#/definitions/a/inner", "definitions": {"a": {"inner": {"type": "integer"}}}}
    out = with_reachable_ref_targets(schema)
    assert out["$ref"].startswith("#/$defs/") and same_language(schema, out)


def test_ignored_ref_siblings():
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"p": {"type": "string"}},
              "properties": {"a": {"$ref": "#/definitions/p", "enum": ["x"]}}}
    assert without_ignored_ref_siblings(draft7)["properties"]["a"] == {"$ref": "#/definitions/p"}
    later = {k: v for k, v in draft7.items() if k != "$schema"}
    assert without_ignored_ref_siblings(later) is later


def test_formats():
    out = with_formats_enforced({"type": "string", "format": "uri-template"})
    assert out == {"type": "string", "pattern": FORMAT_PATTERNS["uri-template"]}


def test_unmatchable_patterns():
    assert never_matches("/^[0-9]{4}$/") and never_matches("a$b") and never_matches("x^|y^")
    assert not never_matches("^a$") and not never_matches("(^a|b)") and not never_matches("$\n")
    schema = {"type": "object", "properties": {"d": {"type": "string", "pattern": "/^[0-9]{4}$/"},
                                               "e": {"pattern": "a^"}, "ok": {"type": "string", "pattern": "^a"}}}
    out = with_unmatchable_patterns_as_no_string(schema)
    assert out["properties"]["d"] is False and out["properties"]["ok"] == schema["properties"]["ok"]
    assert same_language(schema, out)


def test_disjoint_one_of():
    disjoint = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    assert with_disjoint_one_of_as_any_of(disjoint) == {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    overlapping = {"oneOf": [{"type": "number"}, {"type": "integer"}]}
    assert with_disjoint_one_of_as_any_of(overlapping) == overlapping


def test_disjoint_one_of_counts_the_keywords_beside_it():
    """Branches that overlap only outside what the node's other keywords allow are disjoint where it matters."""
    branches = [{"properties": {"kind": {"const": "a"}}}, {"properties": {"kind": {"const": "b"}}}]
    assert "oneOf" in with_disjoint_one_of_as_any_of({"oneOf": branches})  # {} matches both
    schema = {"type": "object", "required": ["kind"], "oneOf": branches}
    out = with_disjoint_one_of_as_any_of(schema)
    assert "oneOf" not in out and same_language(schema, out)


def test_exact_identities():
    schema = {"type": "object", "not": {"required": ["a"]}}
    out = with_exact_identities(schema)
    assert "not" not in repr(out) and same_language(schema, out)


def test_boolean_refs():
    schema = {"properties": {"a": {"$ref": "#/$defs/never"}}, "$defs": {"never": False}}
    assert with_boolean_refs_inlined(schema)["properties"]["a"] is False


def test_unique_items_to_matchers():
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    stripped, plan = without_checked_unique_items(schema)
    assert "uniqueItems" not in stripped and plan.unique_at(())
    numbers = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    stripped, plan = without_checked_unique_items(numbers)
    assert "uniqueItems" not in stripped and plan.numbers_at(()) == "integer"
    bounded = {"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True}  # could run out
    assert without_checked_unique_items(bounded) == (bounded, None)


# ---- the subschema rewrites of `with_exact_identities`, in their declared order ------------------------------
NODE_CASES = {
    "negated_subschema": {"type": "object", "not": {"required": ["a", "b"]}},
    "conditional": {"if": {"required": ["a"]}, "then": {"required": ["b"]}, "else": {"type": "object"}},
    "dependencies": {"dependencies": {"a": ["b"]}},
    "forbidden_required_key": {"type": "object", "properties": {"a": False}, "required": ["a"]},
    "property_names": {"type": "object", "propertyNames": {"enum": ["a", "b"]}},
    "closed_property_count": {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
                              "additionalProperties": False, "maxProperties": 1},
    "at_least_one_property": {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1},
    "property_count_by_presence": {"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1},
    "overlapping_one_of": {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
}


def test_every_subschema_rewrite_has_a_case():
    assert [r.__name__ for r in NODE_REWRITES] == list(NODE_CASES)


@pytest.mark.parametrize("rewrite", NODE_REWRITES, ids=[r.__name__ for r in NODE_REWRITES])
def test_subschema_rewrite_keeps_the_language(rewrite):
    schema = NODE_CASES[rewrite.__name__]
    out = rewrite(dict(schema), schema)
    assert out is not None and out != schema
    assert same_language(schema, out)
    assert rewrite({"type": "string"}, {}) is None  # nothing to rewrite there


def test_property_names_false_leaves_only_the_empty_object():
    schema = {"type": "object", "properties": {"a": {}}, "propertyNames": False}
    out = property_names(dict(schema), schema)
    assert out == {"type": "object", "properties": {"a": False}, "additionalProperties": False}
    assert same_language(schema, out)


def test_object_key_rewrites_give_up_rather_than_guess():
    many = {f"k{i}": {} for i in range(10)}
    assert property_count_by_presence({"properties": many, "minProperties": 2}, {}) is None  # 2**10 branches
    assert property_names({"propertyNames": {"maxLength": 3}}, {}) is None
    assert closed_property_count({"maxProperties": 1, "additionalProperties": True}, {}) is None
    assert at_least_one_property({"minProperties": 2, "properties": {"a": {}}}, {}) is None
    assert dependencies({"dependencies": {f"k{i}": ["a"] for i in range(9)}}, {}) is None
    assert forbidden_required_key({"type": "object", "required": ["a"]}, {}) is None
