"""OpenAI function tools: how the model is told about them and the grammar its calls must follow.

Every call is written as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(the Hermes/Qwen format, which tool-aware templates already teach). The name
and the wrapper are fixed text in the grammar, so the name is always one of the
offered tools and the arguments always match that tool's parameter schema.
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.grammar.schema.productive import without_unproductive_choices
from loraplex.grammar.spec import GrammarKind, GrammarSpec, choice_ebnf
from loraplex.grammar.validation import FunctionTool, ToolRequest

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
CALL_SUFFIX = "}\n" + TOOL_CALL_END


def call_prefix(name: str) -> str:
    return f'{TOOL_CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": '


def format_call(name: str, arguments: str) -> str:
    """A call as the model writes it; used to render earlier assistant turns."""
    return f"{call_prefix(name)}{arguments}{CALL_SUFFIX}"


def template_supports_tools(chat_template: str | None) -> bool:
    """True when the chat template renders a `tools` variable itself (SmolLM2's does not)."""
    return chat_template is not None and "tools" in chat_template


def tools_system_prompt(request: ToolRequest) -> str:
    lines = [
        "You are a helpful assistant with access to the following functions. "
        "Each is described by a JSON object with its name, description and JSON-schema parameters:",
    ]
    lines += [json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in request.offered]
    lines.append(
        "To call a function, reply with a block like this, with the arguments as a JSON object:\n"
        f'{TOOL_CALL_BEGIN}\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n{TOOL_CALL_END}'
    )
    if request.mode == "auto":
        lines.append("Call a function only when it helps answer the user; otherwise answer in plain text.")
    elif request.mode == "named":
        lines.append(f"You must call the function {request.named} now.")
    else:
        lines.append("You must call a function now.")
    if request.mode != "named":
        lines.append(
            "You may call several functions, one block each."
            if request.parallel
            else "Call exactly one function."
        )
    return "\n\n".join(lines)


def tool_call_spec(request: ToolRequest, content_format: dict[str, Any] | None = None) -> GrammarSpec | None:
    """The grammar for the answer; None for tool_choice "none" (the tools are not offered).

    `content_format` (a structural-tag format) constrains the plain-text answer
    that "auto" allows instead of calls, when a response_format asks for one.
    """
    if request.mode == "none":
        return None
    tags = [_call_tag(tool) for tool in request.offered]
    calls_only = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": not request.parallel,
    }
    if request.mode in ("required", "named"):
        fmt = calls_only
    elif content_format is not None:
        fmt = {"type": "or", "elements": [content_format, calls_only]}
    else:
        # Free text until the model writes <tool_call>; from there a well-formed call must follow.
        fmt = {
            "type": "triggered_tags",
            "triggers": [TOOL_CALL_BEGIN],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not request.parallel,
        }
    return GrammarSpec(GrammarKind.STRUCTURAL_TAG, {"type": "structural_tag", "format": fmt}, param="tools")


def content_format_for(spec: GrammarSpec | None) -> dict[str, Any] | None:
    """A response_format's grammar as a structural-tag format, to combine with tool calls."""
    if spec is None:
        return None
    if spec.kind == GrammarKind.JSON_OBJECT:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.kind == GrammarKind.JSON_SCHEMA:
        return {"type": "json_schema", "json_schema": spec.payload}
    if spec.kind == GrammarKind.REGEX:
        return {"type": "regex", "pattern": spec.payload}
    if spec.kind == GrammarKind.EBNF:
        return {"type": "grammar", "grammar": spec.payload}
    return {"type": "grammar", "grammar": choice_ebnf(spec.payload)}


def _call_tag(tool: FunctionTool) -> dict[str, Any]:
    parameters = dict(tool.parameters)
    parameters.setdefault("type", "object")
    # a branch no finite arguments satisfy (validation refused a whole schema of that kind) is one the model
    # must never start: it could not finish the call
    parameters = without_unproductive_choices(parameters)
    return {
        "type": "tag",
        "begin": call_prefix(tool.name),
        "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 1},
        "end": CALL_SUFFIX,
    }


def messages_with_tools(
    messages: list[dict[str, Any]], request: ToolRequest | None, *, template_has_tools: bool
) -> list[dict[str, Any]]:
    """The conversation as the chat template should see it.

    Earlier assistant tool calls and tool results are rendered as text in the
    model's call format for templates that know nothing of tools; the tool list
    goes into the system message unless the template renders `tools` itself.
    """
    if template_has_tools:
        return messages
    rendered = [_render_tool_turn(m) for m in messages]
    if request is None or not request.offered:
        return rendered
    prompt = tools_system_prompt(request)
    if rendered and rendered[0].get("role") in ("system", "developer") and isinstance(rendered[0].get("content"), str):
        first = dict(rendered[0], role="system", content=f"{rendered[0]['content']}\n\n{prompt}")
        return [first, *rendered[1:]]
    return [{"role": "system", "content": prompt}, *rendered]


def _render_tool_turn(message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    if role == "assistant" and message.get("tool_calls"):
        text = message.get("content") or ""
        calls = [
            format_call(call["function"]["name"], call["function"].get("arguments") or "{}")
            for call in message["tool_calls"]
        ]
        return {"role": "assistant", "content": "\n".join([text, *calls] if text else calls)}
    if role == "tool":
        content = message.get("content")
        if not isinstance(content, str):
            content = json.dumps(content)
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return message
