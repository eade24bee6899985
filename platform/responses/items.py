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
from dataclasses import dataclass
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.api.param_policy import UnsupportedParameterError

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(frozen=True, slots=True)
class ItemLimits:
    """What a stored response keeps of the caller's own strings (settings: max_messages, max_item_id_chars,
    max_description_chars); each past its limit is a 400 naming the element."""

    max_items: int = 2048
    max_id_chars: int = 128
    max_description_chars: int = 4096

    @classmethod
    def from_settings(cls, settings: Any) -> ItemLimits:
        return cls(max_items=settings.max_messages, max_id_chars=settings.max_item_id_chars,
                   max_description_chars=settings.max_description_chars)


def normalize_input(raw: str | list[dict[str, Any]], limits: ItemLimits = ItemLimits()) -> list[dict[str, Any]]:
    """The request's input as full items, each with an id (what GET .../input_items returns). Only the fields
    an item type has are kept; ids and call ids a caller chose are bounded."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if len(raw) > limits.max_items:
        raise InvalidRequestError(f"input allows at most {limits.max_items} items; got {len(raw)}", param="input")
    items = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise InvalidRequestError("input items must be objects", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message_item(item, i, limits))
        elif kind == "function_call":
            _require_str(item, ("call_id", "name", "arguments"), i)
            _check_ids(item, ("call_id", "name"), i, limits)
            items.append({"id": _item_id(item, "fc", i, limits), "type": "function_call",
                          "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"],
                          "status": "completed"})
        elif kind == "function_call_output":
            _require_str(item, ("call_id",), i)
            _check_ids(item, ("call_id",), i, limits)
            output = item.get("output")
            if isinstance(output, list):
                output = _joined_text(output, f"input[{i}].output")
            if not isinstance(output, str):
                raise InvalidRequestError("function_call_output needs a string output", param=f"input[{i}].output")
            items.append({"id": _item_id(item, "fco", i, limits), "type": "function_call_output",
                          "call_id": item["call_id"], "output": output, "status": "completed"})
        elif kind == "reasoning":
            continue  # not part of the conversation the model sees
        else:
            raise UnsupportedParameterError(f"input items of type {kind!r} are not supported", param=f"input[{i}].type")
    if not items:
        raise InvalidRequestError("input holds no message or function call item", param="input")
    return items


def _item_id(item: dict[str, Any], prefix: str, index: int, limits: ItemLimits) -> str:
    given = item.get("id")
    if given is None or given == "":
        return new_item_id(prefix)
    if not isinstance(given, str):
        raise InvalidRequestError("an item id must be a string", param=f"input[{index}].id")
    _check_ids(item, ("id",), index, limits)
    return given


def _check_ids(item: dict[str, Any], keys: tuple[str, ...], index: int, limits: ItemLimits) -> None:
    for key in keys:
        if len(item[key]) > limits.max_id_chars:
            raise InvalidRequestError(f"{key} holds {len(item[key])} characters; the limit is {limits.max_id_chars} "
                                      "(max_item_id_chars)", param=f"input[{index}].{key}")


def _message_item(item: dict[str, Any], index: int, limits: ItemLimits) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:  # a list or object would be unhashable: a 400, not a 500
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
    return {"id": _item_id(item, "msg", index, limits), "type": "message", "role": role, "status": "completed",
            "content": [part]}


def _joined_text(parts: list[Any], param: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
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


def public_tools(tools: list[dict[str, Any]] | None, limits: ItemLimits = ItemLimits()) -> list[dict[str, Any]]:
    """The function tools as a response keeps them: the fields a function tool has, nothing else the caller
    added; any other tool type (built-in tools) is refused by name."""
    public = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise UnsupportedParameterError(f"tools of type {kind!r} are not supported; only function tools",
                                            param=f"tools[{i}].type")
        name, description, strict = tool.get("name"), tool.get("description"), tool.get("strict")
        if not isinstance(name, str):
            raise InvalidRequestError("a function tool needs a name", param=f"tools[{i}].name")
        if len(name) > limits.max_id_chars:
            raise InvalidRequestError(f"a tool name may hold at most {limits.max_id_chars} characters "
                                      "(max_item_id_chars)", param=f"tools[{i}].name")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError("a tool description must be a string", param=f"tools[{i}].description")
        if description is not None and len(description) > limits.max_description_chars:
            raise InvalidRequestError(f"a tool description may hold at most {limits.max_description_chars} "
                                      "characters (max_description_chars)", param=f"tools[{i}].description")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError("strict must be a boolean", param=f"tools[{i}].strict")
        public.append({"type": "function", "name": name, "description": description,
                       "parameters": tool.get("parameters") or {"type": "object", "properties": {}}, "strict": strict})
    return public


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Function tools (as `public_tools` keeps them) in chat form."""
    converted = []
    for tool in tools:
        function = {"name": tool["name"], "parameters": tool["parameters"]}
        if tool["description"] is not None:
            function["description"] = tool["description"]
        if tool["strict"] is not None:
            function["strict"] = tool["strict"]
        converted.append({"type": "function", "function": function})
    return converted or None


_TOOL_CHOICE_MODES = frozenset({"none", "auto", "required"})


def public_tool_choice(choice: str | dict[str, Any] | None, limits: ItemLimits = ItemLimits()
                       ) -> str | dict[str, Any] | None:
    """tool_choice as a response keeps it: a mode, or the function it names (no other key survives)."""
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICE_MODES:
            raise InvalidRequestError(f"tool_choice must be one of {', '.join(sorted(_TOOL_CHOICE_MODES))} or a "
                                      "function", param="tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if len(choice["name"]) > limits.max_id_chars:
            raise InvalidRequestError(f"a tool name may hold at most {limits.max_id_chars} characters "
                                      "(max_item_id_chars)", param="tool_choice.name")
        return {"type": "function", "name": choice["name"]}
    raise UnsupportedParameterError(f"tool_choice of type {choice.get('type')!r} is not supported",
                                    param="tool_choice")


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A `public_tool_choice` in chat form."""
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


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
