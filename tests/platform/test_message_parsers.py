"""The platform-side parsers: reasoning split, then tool calls found in the content only."""

from __future__ import annotations

import json

from loraplex.grammar.tools import format_call
from loraplex.platform.extensions import PlainTextParser
from loraplex.platform.reasoning_parser import ReasoningFormat
from loraplex.platform.structured import ReasoningMessageParser, ToolCallMessageParser

CALL = format_call("add", '{"a": 1, "b": 2}')


def run(parser, text: str, step: int, finish_reason: str = "stop"):
    deltas = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)]
    rest, finish_reason = parser.finish(finish_reason)
    deltas.append(rest)
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning_content for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls]
    return content, reasoning, calls, finish_reason


def test_calls_become_tool_calls_and_finish_reason():
    content, reasoning, calls, finish = run(ToolCallMessageParser(PlainTextParser()), CALL, 4)
    assert content == "" and reasoning == "" and finish == "tool_calls"
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "add", "arguments": ""}
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"a": 1, "b": 2}


def test_length_finish_stays_length():
    *_, finish = run(ToolCallMessageParser(PlainTextParser()), CALL[:-25], 3, finish_reason="length")
    assert finish == "length"


def test_plain_text_is_untouched():
    content, _, calls, finish = run(ToolCallMessageParser(PlainTextParser()), "Just text, no call.", 2)
    assert (content, calls, finish) == ("Just text, no call.", [], "stop")


def test_a_call_written_while_reasoning_is_not_a_call():
    text = "<think>maybe I should write " + CALL + "</think>" + CALL
    parser = ToolCallMessageParser(ReasoningMessageParser(ReasoningFormat()))
    content, reasoning, calls, finish = run(parser, text, 5)
    assert reasoning == "maybe I should write " + CALL
    assert content == "" and finish == "tool_calls"
    assert sum(1 for c in calls if "id" in c) == 1
