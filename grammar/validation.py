"""Checks the structured-output fields of a request at the edge: a 400 that names the field.

Syntax of regexes and EBNF is checked by compiling them (xgrammar's parser is
the only one that matters); everything decidable without the tokenizer is
checked here, before any work is queued: the shape of every JSON schema
(depth, number of subschemas) comes first and without recursion, so a
hostile schema is a 400 and never a RecursionError. Whether a strict schema
can be enforced exactly is the compiler's call (it depends on the backends).
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import jsonschema
from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.backends.registry import unenforced_in
from loraplex.grammar.schema.metaschema import check_schema
from loraplex.grammar.schema.productive import NO_FINITE_VALUE, admits_no_finite_value
from loraplex.grammar.schema.walk import SchemaShapeLimits, shape_problem
from loraplex.grammar.spec import GrammarKind, GrammarSpec

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar", "choice")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

DEFAULT_SHAPE_LIMITS = SchemaShapeLimits()
DEFAULT_MAX_TOOLS = 128  # as OpenAI


def response_format_spec(response_format: Any, *, limits: SchemaShapeLimits = DEFAULT_SHAPE_LIMITS) -> GrammarSpec | None:
    """The grammar a `response_format` asks for; None for plain text."""
    param = "response_format"
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidRequestError("response_format must be an object with a `type`", param=param)
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise InvalidRequestError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}",
            param="response_format.type",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT, None, param=param)
    if kind == "json_schema":
        return _json_schema_spec(response_format.get("json_schema"), limits)
    if kind == "regex":
        pattern = response_format.get("regex")
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError("response_format.regex must be a non-empty string", param="response_format.regex")
        return GrammarSpec(GrammarKind.REGEX, pattern, param="response_format.regex")
    if kind == "grammar":
        text = response_format.get("grammar")
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequestError(
                "response_format.grammar must be a non-empty EBNF string with a `root` rule",
                param="response_format.grammar",
            )
        return GrammarSpec(GrammarKind.EBNF, text, param="response_format.grammar")
    choices = response_format.get("choices")
    if (
        not isinstance(choices, list)
        or not choices
        or any(not isinstance(c, str) or not c for c in choices)
    ):
        raise InvalidRequestError(
            "response_format.choices must be a non-empty list of non-empty strings",
            param="response_format.choices",
        )
    return GrammarSpec(GrammarKind.CHOICE, choices, param="response_format.choices")


def _json_schema_spec(json_schema: Any, limits: SchemaShapeLimits) -> GrammarSpec:
    param = "response_format.json_schema"
    if not isinstance(json_schema, dict):
        raise InvalidRequestError("response_format.json_schema must be an object with `name` and `schema`", param=param)
    name = json_schema.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(
            "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -",
            param=f"{param}.name",
        )
    schema = json_schema.get("schema", {})
    strict = json_schema.get("strict") or False
    if not isinstance(strict, bool):
        raise InvalidRequestError("response_format.json_schema.strict must be a boolean", param=f"{param}.strict")
    check_json_schema(schema, param=f"{param}.schema", strict=False, limits=limits)
    return GrammarSpec(GrammarKind.JSON_SCHEMA, schema, param=f"{param}.schema", strict=strict)


def check_spec_sizes(fields: dict[str, Any], max_bytes: int) -> None:
    """Raise a 400 naming the first of `fields` (tools, tool_choice, response_format) larger than `max_bytes` as
    JSON. Checked before any schema in them is walked: checking a schema costs ~0.5 ms of CPU a subschema, so
    without it one request's tools (128 of 20,000 subschemas each) could cost minutes."""
    for name, value in fields.items():
        if value is None:
            continue
        try:
            size = len(json.dumps(value))
        except RecursionError:
            raise InvalidRequestError(f"{name} nests too deep", param=name) from None
        if size > max_bytes:
            raise InvalidRequestError(f"{name} is larger than {max_bytes} bytes as JSON", param=name)


def check_json_schema(schema: Any, *, param: str, strict: bool,
                      limits: SchemaShapeLimits = DEFAULT_SHAPE_LIMITS) -> None:
    """Raise a 400 if `schema` is too deep or large, not a valid JSON schema, or (strict) uses a keyword the
    backend of tool calls does not enforce (a strict tool's parameters: the registry says which backend)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    problem = shape_problem(schema, limits)
    if problem:
        raise InvalidRequestError(f"{param} is too complex: {problem}", param=param)
    problem = _SCHEMA_VERDICTS.problem(schema, strict)
    if problem:
        raise InvalidRequestError(f"{param} {problem}", param=param)


def _schema_problem(schema: dict[str, Any], strict: bool) -> str | None:
    """What is wrong with a schema of an accepted shape, worded to follow its param; None when nothing is."""
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        check_schema(validator, schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return f"is not a valid JSON schema at {where}: {exc.message}"
    if admits_no_finite_value(schema):
        return f"cannot be satisfied: {NO_FINITE_VALUE}"
    if strict:
        unenforced = unenforced_in(GrammarKind.STRUCTURAL_TAG, schema)
        if unenforced:
            return f"is not supported in strict mode: keyword {unenforced.keyword!r} at {unenforced.path}"
    return None


class _SchemaVerdicts:
    """The verdicts of the last schemas checked, by their canonical JSON. Checking one against its draft's
    metaschema costs jsonschema ~0.5 ms of CPU a subschema (seconds for a schema near the size limits), and
    tenants send the same schemas request after request, as they do with the compiled grammars."""

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()  # checked in threads off the event loop

    def problem(self, schema: dict[str, Any], strict: bool) -> str | None:
        key = GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=strict).cache_key()  # the compiled grammars' key
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        verdict = _schema_problem(schema, strict)
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > self.max_entries:
                self._verdicts.popitem(last=False)
        return verdict


_SCHEMA_VERDICTS = _SchemaVerdicts()


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The validated tool fields of a chat request. `mode` is auto, required, none or named."""

    tools: tuple[FunctionTool, ...]
    mode: str
    named: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> tuple[FunctionTool, ...]:
        """The tools the model sees and may call."""
        if self.mode == "none":
            return ()
        if self.mode == "named":
            return tuple(t for t in self.tools if t.name == self.named)
        return self.tools


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any, *, max_tools: int = DEFAULT_MAX_TOOLS,
                limits: SchemaShapeLimits = DEFAULT_SHAPE_LIMITS) -> ToolRequest | None:
    """Validate `tools`, `tool_choice` and `parallel_tool_calls`; None when no tools were given.

    Linear in the number of tools, which is itself capped before any tool is looked at."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools", param="tools")
    if len(tools) > max_tools:
        raise InvalidRequestError(f"tools holds {len(tools)} tools; the limit is {max_tools}", param="tools")
    parsed: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        parsed.append(_parse_tool(tool, f"tools[{i}]", limits))
    names = [t.name for t in parsed]
    duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
    if duplicates:
        raise InvalidRequestError(f"duplicate tool names: {', '.join(duplicates)}", param="tools")
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tool_choice is None:
        return ToolRequest(tuple(parsed), "auto", parallel=parallel_tool_calls)
    if tool_choice in ("auto", "required", "none"):
        return ToolRequest(tuple(parsed), tool_choice, parallel=parallel_tool_calls)
    named = _named_choice(tool_choice)
    if named not in names:
        raise InvalidRequestError(
            f"tool_choice names function {named!r}, which is not among the given tools ({', '.join(names)})",
            param="tool_choice",
        )
    return ToolRequest(tuple(parsed), "named", named=named, parallel=False)


def _parse_tool(tool: Any, param: str, limits: SchemaShapeLimits) -> FunctionTool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=param)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{param}.function must be an object", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(
            f"{param}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -", param=f"{param}.function.name"
        )
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"{param}.function.description must be a string", param=f"{param}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequestError(
            f"{param}.function.parameters must be a JSON schema of type object", param=f"{param}.function.parameters"
        )
    strict = function.get("strict") or False
    if not isinstance(strict, bool):
        raise InvalidRequestError(f"{param}.function.strict must be a boolean", param=f"{param}.function.strict")
    # the call's grammar takes the parameters as an object (grammar/tools.py), so they are checked as one
    check_json_schema({"type": "object", **parameters}, param=f"{param}.function.parameters", strict=strict,
                      limits=limits)
    return FunctionTool(name, description, parameters, strict)


def _named_choice(tool_choice: Any) -> str:
    ok = (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and isinstance(tool_choice["function"].get("name"), str)
    )
    if not ok:
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return tool_choice["function"]["name"]
