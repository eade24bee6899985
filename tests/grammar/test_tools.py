from __future__ import annotations

import pytest
from grammar_helpers import feed
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from loraplex.grammar.tools import (
    call_prefix,
    content_format_for,
    format_call,
    messages_with_tools,
    template_supports_tools,
    tool_call_spec,
)
from loraplex.grammar.validation import parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALL_WEATHER = format_call("get_weather", '{"city": "Paris"}')
CALL_ADD = format_call("add", '{"a": 1, "b": 2}')
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


def grammar_for(compiler, tool_choice, parallel=True, response_format=None):
    request = parse_tools([WEATHER, ADD], tool_choice, parallel)
    return compiler.compile_blocking(tool_call_spec(request, content_format_for(response_format)))


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "text", "accepted", "terminated"),
    [
        ("required", True, CALL_WEATHER, True, False),          # another call may follow
        ("required", True, CALL_WEATHER + "\n" + CALL_ADD, True, False),
        ("required", False, CALL_WEATHER, True, True),          # exactly one call, then the answer ends
        ("required", False, CALL_WEATHER + "\n" + CALL_ADD, False, True),
        ("required", True, "The weather is nice", False, False),
        ("required", True, format_call("get_weather", '{"town": "Paris"}'), False, False),  # schema-invalid
        ("required", True, format_call("rm_rf", "{}"), False, False),                      # unknown tool
        (NAMED_ADD, True, CALL_ADD, True, True),
        (NAMED_ADD, True, CALL_WEATHER, False, False),
        ("auto", True, "It is sunny in Paris.", True, False),
        ("auto", True, "Let me check. " + CALL_WEATHER, True, False),
        ("auto", False, CALL_ADD, True, True),
        ("auto", True, "Let me check. " + format_call("add", '{"a": "one"}'), False, False),
    ],
)
def test_tool_call_grammar(compiler, tokenizer, tool_choice, parallel, text, accepted, terminated):
    grammar = grammar_for(compiler, tool_choice, parallel)
    matcher, ok = feed(grammar, tokenizer, text)
    assert ok is accepted
    if accepted:
        assert matcher.is_terminated() is terminated


def test_a_branch_of_the_arguments_no_finite_value_satisfies_is_never_started(compiler, tokenizer):
    """`x` is a number or an object that must hold another such object without end: a model starting the
    object could never close the call, so the grammar offers the number alone."""
    endless = {"type": "object", "properties": {"inner": {"$ref": "#/$defs/endless"}}, "required": ["inner"]}
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"anyOf": [{"$ref": "#/$defs/endless"}, {"type": "integer"}]}},
        "required": ["x"], "$defs": {"endless": endless}}}}
    grammar = compiler.compile_blocking(tool_call_spec(parse_tools([tool], "required", False)))
    matcher, ok = feed(grammar, tokenizer, format_call("pick", '{"x": 4}'))
    assert ok and matcher.is_terminated()
    _, ok = feed(grammar, tokenizer, call_prefix("pick") + '{"x": {')
    assert not ok


def test_tool_choice_none_has_no_grammar():
    assert tool_call_spec(parse_tools([WEATHER], "none", None)) is None


def test_auto_with_response_format_allows_schema_content_or_calls(compiler, tokenizer):
    rf = GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    grammar = grammar_for(compiler, "auto", response_format=rf)
    for text, accepted in [('{"x": 3}', True), (CALL_ADD, True), ("free text", False)]:
        _, ok = feed(grammar, tokenizer, text)
        assert ok is accepted, text


def test_smollm2_template_has_no_tools_so_a_system_prompt_describes_them(tokenizer):
    assert not template_supports_tools(tokenizer.chat_template)
    request = parse_tools([WEATHER, ADD], "required", False)
    messages = messages_with_tools(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
        request, template_has_tools=False,
    )
    system = messages[0]["content"]
    assert system.startswith("Be brief.") and '"name": "get_weather"' in system and "<tool_call>" in system
    assert "exactly one" in system
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "get_weather" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_earlier_tool_turns_render_as_text(tokenizer):
    history = [
        {"role": "user", "content": "Add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    messages = messages_with_tools(history, parse_tools([ADD], "auto", None), template_has_tools=False)
    assert messages[2]["content"] == CALL_ADD
    assert messages[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
