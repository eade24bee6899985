"""Tool calls found in the model's streamed text, emitted as OpenAI streams them."""

from __future__ import annotations

import json

import pytest
from loraplex.grammar.tools import format_call
from loraplex.platform.tool_call_parser import ToolCallStreamParser

CALL_WEATHER = format_call("get_weather", '{"city": "Paris"}')
CALL_ADD = format_call("add", '{"a": 1, "b": 2}')


def stream(parser: ToolCallStreamParser, text: str, step: int):
    deltas = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)]
    deltas.append(parser.finish())
    return deltas


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_stream_parser_reassembles_calls_like_the_openai_client(step):
    text = "Let me look.\n" + CALL_WEATHER + "\n" + CALL_ADD
    parser = ToolCallStreamParser()
    deltas = stream(parser, text, step)
    content = "".join(d.content for d in deltas)
    assert content.strip() == "Let me look."
    rebuilt: dict[int, dict] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            data = call.as_openai()
            entry = rebuilt.setdefault(data["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in data:
                assert entry["id"] is None and data["function"]["arguments"] == ""
                entry["id"], entry["name"] = data["id"], data["function"]["name"]
            entry["arguments"] += data["function"]["arguments"]
    assert [(c["name"], json.loads(c["arguments"])) for c in rebuilt.values()] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2}),
    ]
    assert all(c["id"].startswith("call_") for c in rebuilt.values())
    assert [c.as_openai()["function"]["arguments"] for c in parser.calls] == ['{"city": "Paris"}', '{"a": 1, "b": 2}']
    assert all(c.complete for c in parser.calls)


def test_stream_parser_holds_back_a_partial_marker_then_releases_plain_text():
    parser = ToolCallStreamParser()
    assert parser.feed("a < b and <tool").content == "a < b and "
    assert parser.feed("bar>").content == "<toolbar>"
    parser.finish()
    assert parser.calls == [] and parser.final_content == "a < b and <toolbar>"


def test_stream_parser_calls_only_has_no_content():
    parser = ToolCallStreamParser()
    stream(parser, CALL_ADD + "\n" + CALL_WEATHER, 3)
    assert parser.final_content is None and len(parser.calls) == 2


def test_stream_parser_drops_a_next_call_cut_off_at_its_marker():
    """max_tokens landing inside the second `<tool_call>`: the fragment is markup, never content."""
    parser = ToolCallStreamParser()
    stream(parser, CALL_WEATHER + "\n<tool", 2)
    assert parser.final_content is None and len(parser.calls) == 1 and parser.calls[0].complete


def test_stream_parser_unfinished_call_is_incomplete():
    parser = ToolCallStreamParser()
    stream(parser, CALL_WEATHER[:-20], 4)
    assert len(parser.calls) == 1 and not parser.calls[0].complete
