"""Responses items <-> chat messages, and Responses tools/format <-> their chat-completions forms.

One conversion serves both directions of a chain: the output items of a
response become chat messages by the same function as input items, so a
chain continued with `previous_response_id` and the same conversation sent
back item by item render the identical prompt (and continue the same KV).
Reasoning items are not part of the conversation (as in chat, clients do
not send reasoning back).
"""

from __future__ import annotations

import secrets
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.api.param_policy import UnsupportedParameterError

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def normalize_input(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as full items, each with an id (what GET .../input_items returns)."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    items = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message_item(item, i))
        elif kind == "function_call":
            _require_str(item, ("call_id", "name", "arguments"), i)
            items.append({"id": item.get("id") or new_item_id("fc"), "type": "function_call",
                          "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"],
                          "status": "completed"})
        elif kind == "function_call_output":
            _require_str(item, ("call_id",), i)
            output = item.get("output")
            if isinstance(output, list):
                output = _joined_text(output, f"input[{i}].output")
            if not isinstance(output, str):
                raise InvalidRequestError("function_call_output needs a string output", param=f"input[{i}].output")
            items.append({"id": item.get("id") or new_item_id("fco"), "type": "function_call_output",
                          "call_id": item["call_id"], "output": output, "status": "completed"})
        elif kind == "reasoning":
            continue  # not part of the conversation the model sees
        else:
            raise UnsupportedParameterError(f"input items of type {kind!r} are not supported", param=f"input[{i}].type")
    if not items:
        raise InvalidRequestError("input holds no message or function call item", param="input")
    return items


def _message_item(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidRequestError(f"unknown role {role!r}", param=f"input[{index}].role")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = _joined_text(content, f"input[{index}].content")
    else:
        raise InvalidRequestError("message content must be a string or a list of parts", param=f"input[{index}].content")
    part_type = "output_text" if role == "assistant" else "input_text"
    part: dict[str, Any] = {"type": part_type, "text": text}
    if part_type == "output_text":
        part["annotations"] = []
    return {"id": item.get("id") or new_item_id("msg"), "type": "message", "role": role, "status": "completed",
            "content": [part]}


def _joined_text(parts: list[Any], param: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedParameterError(f"content part type {kind!r} is not supported; only text",
                                            param=f"{param}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _require_str(item: dict[str, Any], keys: tuple[str, ...], index: int) -> None:
    for key in keys:
        if not isinstance(item.get(key), str):
            raise InvalidRequestError(f"{item.get('type')} items need a string {key}", param=f"input[{index}].{key}")


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of normalized items: an assistant's text and its function calls form one message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(part["text"] for part in item["content"])
            messages.append({"role": _ROLES[item["role"]], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat form; any other tool type (built-in tools) is refused by name."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise UnsupportedParameterError(f"tools of type {tool.get('type')!r} are not supported; only function tools",
                                            param=f"tools[{i}].type")
        if not isinstance(tool.get("name"), str):
            raise InvalidRequestError("a function tool needs a name", param=f"tools[{i}].name")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise UnsupportedParameterError(f"tool_choice of type {choice.get('type')!r} is not supported",
                                    param="tool_choice")


def chat_response_format(fmt: Any) -> dict[str, Any] | None:
    """text.format (a TextFormat) in chat's response_format form."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise InvalidRequestError("text.format json_schema needs a schema", param="text.format.schema")
    spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


def public_format(fmt: Any) -> dict[str, Any]:
    if fmt is None or fmt.type == "text":
        return {"type": "text"}
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict,
            "description": fmt.description}
