"""vLLM's request extensions, translated at the edge into what the rest of the platform already speaks.

People migrating from vLLM send `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` (or the newer `structured_outputs`
object), `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `chat_template_kwargs`, `add_generation_prompt` and
`continue_final_message`. Structured output becomes an ordinary
`response_format` (so the grammar preparer, its cache and its errors are the
same), sampling knobs land on SamplingParams, template options on the chat
template call. Nothing downstream knows these names.
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.protocol import SamplingParams
from loraplex.platform.api.strict_json import loads_strict

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")

# structured_outputs key -> (response_format type, the key its payload goes under)
_STRUCTURED_KEYS: dict[str, tuple[str, str | None]] = {
    "json": ("json_schema", None),
    "regex": ("regex", "regex"),
    "choice": ("choice", "choices"),
    "grammar": ("grammar", "grammar"),
    "json_object": ("json_object", None),
}
_GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}

# apply_chat_template's own parameters: a tenant's chat_template_kwargs must not reach them (a
# `chat_template` would run the tenant's own Jinja, `tokenize`/`return_dict` would change the result type).
_TEMPLATE_CALL_PARAMS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# The template's own functions, which a variable of the same name would shadow (a call to it then fails):
# jinja2's default globals and those transformers adds for chat templates.
_TEMPLATE_GLOBALS = frozenset({
    "range", "dict", "lipsum", "cycler", "joiner", "namespace", "raise_exception", "strftime_now",
})


def structured_response_format(body: Any) -> dict[str, Any] | None:
    """The `response_format` that the request's guided_* / structured_outputs fields mean; None if unset.

    At most one way to ask for structure: two would leave it unclear which one wins.
    """
    given = {name: getattr(body, name) for name in GUIDED_FIELDS if getattr(body, name, None) is not None}
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        given["structured_outputs"] = structured
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(f"give only one of {', '.join(sorted(given))}", param=sorted(given)[1])
    if getattr(body, "response_format", None) is not None:
        name = next(iter(given))
        raise InvalidRequestError(f"{name} and response_format cannot be combined; give one", param=name)
    name, value = next(iter(given.items()))
    if name == "structured_outputs":
        return _from_structured_outputs(value)
    return _response_format(_GUIDED_KEYS[name], value, param=name)


def _from_structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
    chosen = {k: v for k, v in value.items() if v is not None and v is not False}
    for key in chosen:
        if key not in _STRUCTURED_KEYS:
            raise InvalidRequestError(
                f"structured_outputs.{key} is not supported; use one of {', '.join(_STRUCTURED_KEYS)}",
                param=f"structured_outputs.{key}",
            )
    if len(chosen) != 1:
        raise InvalidRequestError(
            f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KEYS)}", param="structured_outputs"
        )
    key, payload = next(iter(chosen.items()))
    return _response_format(key, payload, param=f"structured_outputs.{key}")


def _response_format(key: str, payload: Any, *, param: str) -> dict[str, Any]:
    kind, field_name = _STRUCTURED_KEYS[key]
    if key == "json_object":
        if payload is not True:
            raise InvalidRequestError(f"{param} must be true", param=param)
        return {"type": kind}
    if key == "json":
        return {"type": kind, "json_schema": {"name": "guided_json", "schema": _json_schema(payload, param)}}
    if key == "choice":
        if not isinstance(payload, list) or not payload or any(not isinstance(c, str) or not c for c in payload):
            raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings", param=param)
    elif not isinstance(payload, str) or not payload.strip():
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return {"type": kind, str(field_name): payload}


def _json_schema(payload: Any, param: str) -> dict[str, Any]:
    """vLLM takes the schema as an object or as JSON text."""
    if isinstance(payload, str):
        try:
            payload = loads_strict(payload.encode())  # the API's own parser: too deep or too long is malformed
        except json.JSONDecodeError:
            raise InvalidRequestError(f"{param} is neither a JSON schema object nor JSON text", param=param) from None
    if not isinstance(payload, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    return payload


def apply_sampling_extensions(body: Any, sampling: SamplingParams) -> None:
    """min_tokens, stop_token_ids, include_stop_str_in_output and skip_special_tokens onto SamplingParams."""
    if getattr(body, "min_tokens", None) is not None:
        sampling.min_tokens = body.min_tokens
    if getattr(body, "stop_token_ids", None):
        sampling.stop_token_ids = list(body.stop_token_ids)
    sampling.include_stop_str_in_output = bool(getattr(body, "include_stop_str_in_output", False))
    sampling.skip_special_tokens = bool(getattr(body, "skip_special_tokens", True))


def chat_template_options(body: Any, max_kwargs_bytes: int) -> dict[str, Any]:
    """Keyword arguments for the chat template: the tenant's variables (at most `max_kwargs_bytes` as JSON) and
    where the prompt ends."""
    options: dict[str, Any] = dict(_checked_template_kwargs(getattr(body, "chat_template_kwargs", None),
                                                            max_kwargs_bytes))
    continue_final = bool(getattr(body, "continue_final_message", False))
    add_generation_prompt = getattr(body, "add_generation_prompt", None)
    if continue_final:
        if add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
            )
        messages = getattr(body, "messages", None) or []
        if not messages or messages[-1].role != "assistant":
            raise InvalidRequestError(
                "continue_final_message needs the last message to be the assistant's", param="continue_final_message"
            )
        options["continue_final_message"] = True
        options["add_generation_prompt"] = False
    elif add_generation_prompt is not None:
        options["add_generation_prompt"] = bool(add_generation_prompt)
    return options


def _checked_template_kwargs(kwargs: dict[str, Any] | None, max_bytes: int) -> dict[str, Any]:
    if not kwargs:
        return {}
    for name in kwargs:
        reserved = name in _TEMPLATE_CALL_PARAMS or name in _TEMPLATE_GLOBALS
        if reserved or not name.isidentifier() or name.startswith("_"):
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {name!r}", param=f"chat_template_kwargs.{name}"
            )
    try:
        size = len(json.dumps(kwargs, default=str))
    except RecursionError:
        raise InvalidRequestError("chat_template_kwargs nests too deep", param="chat_template_kwargs") from None
    if size > max_bytes:
        raise InvalidRequestError(
            f"chat_template_kwargs is larger than {max_bytes} bytes as JSON", param="chat_template_kwargs"
        )
    return kwargs
