"""Which request fields we honour, accept as harmless, or refuse: one table per decision.

OpenAI ignores nothing silently and neither do we: a parameter we cannot
honour is a 400 `unsupported_parameter` naming it, so a client never believes
it got audio, predicted outputs or a priority tier it did not get. A field no
API defines (a typo, a vendor's private knob) is a 400 `unknown_parameter`.
Fields a request model declares are handled by the model itself; this module
screens everything else, before any field is validated.
"""

from __future__ import annotations

from typing import Any

from loraplex.engine.errors import InvalidRequestError


class UnsupportedParameterError(InvalidRequestError):
    code = "unsupported_parameter"


class UnknownParameterError(InvalidRequestError):
    code = "unknown_parameter"


# OpenAI parameters whose meaning we cannot provide: refused when given a value (null means "not given").
OPENAI_REFUSED: dict[str, str] = {
    "audio": "audio output is not supported; this server generates text",
    "functions": "the legacy `functions` parameter is not supported; use `tools`",
    "function_call": "the legacy `function_call` parameter is not supported; use `tool_choice`",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    "verbosity": "verbosity is not supported; bound the answer with max_completion_tokens",
}

# vLLM sampling/serving knobs that we do not implement; named apart from typos so the message can say so.
VLLM_REFUSED = frozenset({
    "use_beam_search", "length_penalty", "early_stopping", "truncate_prompt_tokens", "prompt_logprobs",
    "spaces_between_special_tokens", "add_special_tokens", "documents", "chat_template", "mm_processor_kwargs",
    "guided_decoding_backend", "guided_whitespace_pattern", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "bad_words", "allowed_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "prompt_embeds", "min_tokens_for_stop", "echo", "thinking_token_budget",
})


def screen_fields(data: Any, *, declared: frozenset[str]) -> Any:
    """The body without null-valued refused fields; raises for any other field the model does not declare."""
    if not isinstance(data, dict):
        return data  # the model reports the wrong type itself
    screened: dict[str, Any] = {}
    for name, value in data.items():
        if name in declared:
            screened[name] = value
        elif name in OPENAI_REFUSED:
            if value is not None:
                raise UnsupportedParameterError(f"{name}: {OPENAI_REFUSED[name]}", param=name)
        elif name in VLLM_REFUSED:
            raise UnsupportedParameterError(f"{name} (a vLLM extension) is not supported by this server", param=name)
        else:
            raise UnknownParameterError(f"Unrecognized request argument supplied: {name}", param=name)
    return screened


# service_tier values that ask for nothing beyond what every request gets.
PLAIN_SERVICE_TIERS = frozenset({"auto", "default"})


def check_harmless(*, service_tier: str | None, modalities: list[str] | None, metadata: dict[str, str] | None) -> None:
    """Accepted-and-harmless fields are only harmless for values that ask for nothing we lack."""
    if service_tier is not None and service_tier not in PLAIN_SERVICE_TIERS:
        raise UnsupportedParameterError(
            f"service_tier {service_tier!r} is not offered; use 'auto' or 'default'", param="service_tier"
        )
    if modalities is not None and any(m != "text" for m in modalities):
        raise UnsupportedParameterError("only the 'text' modality is supported", param="modalities")
    if metadata is not None:
        # OpenAI's limits: 16 pairs, keys of 64 and values of 512 characters.
        if len(metadata) > 16:
            raise InvalidRequestError("metadata holds at most 16 key-value pairs", param="metadata")
        for key, value in metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise InvalidRequestError("metadata keys are at most 64 and values 512 characters", param="metadata")
