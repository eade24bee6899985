"""The backend registry is the only way to a backend: it lists them, builds them, orders them per spec and
says what the backend of a kind would not enforce (the edge's strict tool check asks it, not a library)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from loraplex.grammar.backends import registry
from loraplex.grammar.backends.protocol import Unsupported
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from loraplex.grammar.validation import parse_tools


class ChoiceOnlyBackend:
    """A plug-in for one kind; never built here (nothing compiles through it in these tests)."""

    name: ClassVar[str] = "choices-only"
    kinds: ClassVar[frozenset[str]] = frozenset({GrammarKind.CHOICE})

    def __init__(self, context: Any) -> None:
        self.context = context

    @classmethod
    def unsupported(cls, schema: Any) -> Unsupported | None:
        return Unsupported("everything", "#", cls.name)


@pytest.fixture
def plugged():
    registry.register_backend(ChoiceOnlyBackend)
    try:
        yield
    finally:
        del registry.GRAMMAR_BACKENDS[ChoiceOnlyBackend.name]


def test_the_builtin_backends_are_registered():
    assert set(registry.GRAMMAR_BACKENDS) == {"llguidance", "xgrammar"}


def test_auto_order_per_kind():
    strict = GrammarSpec(GrammarKind.JSON_SCHEMA, {}, strict=True)
    loose = GrammarSpec(GrammarKind.JSON_SCHEMA, {})
    backends = registry.GRAMMAR_BACKENDS
    assert registry.backend_order(strict, backends) == [("llguidance", True)]
    assert registry.backend_order(loose, backends) == [("llguidance", True), ("xgrammar", False)]
    assert registry.backend_order(GrammarSpec(GrammarKind.REGEX, "a"), backends) == [("xgrammar", True)]


def test_a_registered_plugin_is_chosen_by_name(plugged):
    spec = GrammarSpec(GrammarKind.CHOICE, ["a", "b"])
    assert registry.backend_order(spec, registry.GRAMMAR_BACKENDS, "choices-only") == [("choices-only", True)]
    registry.check_choice("choices-only")
    with pytest.raises(ValueError, match="unknown grammar backend"):
        registry.check_choice("nope")


def test_what_a_kind_does_not_enforce_comes_from_its_backend():
    # tool calls compile with xgrammar, which ignores `not`: the registry says so, naming where
    found = registry.unenforced_in(GrammarKind.STRUCTURAL_TAG, {"properties": {"a": {"not": {"type": "null"}}}})
    assert (found.keyword, found.path, found.backend) == ("not", "#/properties/a", "xgrammar")
    found = registry.unenforced_in(GrammarKind.STRUCTURAL_TAG, {"type": "string", "format": "uri-template"})
    assert found.keyword == "format: uri-template"
    assert registry.unenforced_in(GrammarKind.STRUCTURAL_TAG, {"type": "string", "format": "textarea"}) is None


def test_strict_tool_parameters_are_checked_through_the_registry():
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"u": {"type": "string", "format": "uri-template"}}}}}
    with pytest.raises(Exception, match=r"keyword 'format: uri-template' at #/properties/u"):
        parse_tools([tool], None, None)
    tool["function"]["strict"] = False
    assert parse_tools([tool], None, None).tools[0].name == "f"
