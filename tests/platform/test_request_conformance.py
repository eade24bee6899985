"""The request edge without a server: parameter screening, vLLM translation, limits, fingerprints, settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.api.fingerprint import _fingerprint, system_fingerprint, weights_identity
from loraplex.platform.api.param_policy import UnknownParameterError, UnsupportedParameterError
from loraplex.platform.api.request_limits import RequestLimits, check_request_limits
from loraplex.platform.api.retry_hints import retry_headers
from loraplex.platform.api.schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.api.vllm_compat import chat_template_options
from loraplex.platform.errors import validation_param
from loraplex.platform.settings import Settings
from pydantic import ValidationError

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def test_null_refused_fields_are_absent_fields() -> None:
    body = chat(audio=None, functions=None, store=True, metadata={"k": "v"}, service_tier="auto")
    assert body.store is True and body.metadata == {"k": "v"}


@pytest.mark.parametrize(("fields", "error", "param"), [
    ({"audio": {"voice": "alloy"}}, UnsupportedParameterError, "audio"),
    ({"function_call": "auto"}, UnsupportedParameterError, "function_call"),
    ({"use_beam_search": False}, UnsupportedParameterError, "use_beam_search"),
    ({"service_tier": "flex"}, UnsupportedParameterError, "service_tier"),
    ({"modalities": ["audio"]}, UnsupportedParameterError, "modalities"),
    ({"temprature": 0.2}, UnknownParameterError, "temprature"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, InvalidRequestError, "metadata"),
])
def test_screening_names_the_parameter(fields: dict, error: type, param: str) -> None:
    with pytest.raises(error) as raised:
        chat(**fields)
    assert raised.value.param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"parallel_tool_calls": "false"}, "parallel_tool_calls"),
    ({"seed": "1"}, "seed"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"logit_bias": {"5": "10"}}, "logit_bias"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]"),
])
def test_scalars_take_json_types_as_sent(fields: dict, param: str) -> None:
    """A string or boolean where a number goes (or anything but true/false where a boolean goes) is refused, as
    OpenAI does, where lax parsing would run `"stream": "yes"` as a stream and `"seed": "1"` as a seed."""
    with pytest.raises(ValidationError) as raised:
        chat(**fields)
    assert validation_param(raised.value.errors())[0] == param


def test_whole_floats_are_integers_and_integers_are_floats() -> None:
    body = chat(max_tokens=16.0, temperature=1, seed=7)
    assert (body.max_tokens, body.temperature, body.seed) == (16, 1.0, 7)
    assert isinstance(body.max_tokens, int)
    with pytest.raises(ValidationError):
        chat(max_tokens=16.5)
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({"model": "m", "prompt": [1, "2"]})
    assert "prompt" in validation_param(raised.value.errors())[0]


def test_completions_refuse_chat_only_fields() -> None:
    with pytest.raises(UnknownParameterError) as raised:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "messages": MESSAGES})
    assert raised.value.param == "messages"
    with pytest.raises(UnknownParameterError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "continue_final_message": True})


@pytest.mark.parametrize(("fields", "expected"), [
    ({"guided_json": {"type": "object"}},
     {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": {"type": "object"}}}),
    ({"guided_json": '{"type": "object"}'},
     {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": {"type": "object"}}}),
    ({"guided_regex": "[a-z]+"}, {"type": "regex", "regex": "[a-z]+"}),
    ({"guided_choice": ["a", "b"]}, {"type": "choice", "choices": ["a", "b"]}),
    ({"guided_grammar": 'root ::= "x"'}, {"type": "grammar", "grammar": 'root ::= "x"'}),
    ({"structured_outputs": {"choice": ["a"], "regex": None}}, {"type": "choice", "choices": ["a"]}),
    ({"structured_outputs": {"json_object": True}}, {"type": "json_object"}),
])
def test_vllm_structured_output_becomes_response_format(fields: dict, expected: dict) -> None:
    assert chat(**fields).response_format == expected
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}).response_format == expected


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "text"}}, "guided_regex"),
    ({"guided_regex": "  "}, "guided_regex"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"min_tokens": 9, "max_completion_tokens": 8}, "min_tokens"),
])
def test_vllm_mistakes_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        chat(**fields)
    assert raised.value.param == param


def test_template_options() -> None:
    limit = Settings().chat_template_kwargs_max_bytes
    assert chat_template_options(chat(), limit) == {}
    assert chat_template_options(chat(chat_template_kwargs={"enable_thinking": False}, add_generation_prompt=False),
                                 limit) == {"enable_thinking": False, "add_generation_prompt": False}
    continued = chat(messages=[*MESSAGES, {"role": "assistant", "content": "Sure"}], continue_final_message=True)
    assert chat_template_options(continued, limit) == {"continue_final_message": True, "add_generation_prompt": False}
    assert chat_template_options(chat(chat_template_kwargs={"big": "x" * 100}), 200) == {"big": "x" * 100}
    for bad, param in (({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs.chat_template"),
                       ({"chat_template_kwargs": {"_private": 1}}, "chat_template_kwargs._private"),
                       ({"chat_template_kwargs": {"namespace": 1}}, "chat_template_kwargs.namespace"),
                       ({"chat_template_kwargs": {"strftime_now": 1}}, "chat_template_kwargs.strftime_now"),
                       ({"chat_template_kwargs": {"big": "x" * 20_000}}, "chat_template_kwargs"),
                       ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message")):
        with pytest.raises(InvalidRequestError) as raised:
            chat_template_options(chat(messages=[*MESSAGES, {"role": "assistant", "content": "S"}], **bad), limit)
        assert raised.value.param == param


def test_limits_come_from_settings_and_name_the_parameter() -> None:
    limits = RequestLimits.from_settings(Settings(max_stop_sequences=2, max_n=3, max_prompts=2, max_messages=1))
    check_request_limits(chat(stop=["a", "b"], n=3), limits)
    cases = [
        (chat(stop=["a", "b", "c"]), "stop"),
        (chat(n=4), "n"),
        (chat(messages=MESSAGES * 2), "messages"),
        (CompletionRequest(model="m", prompt=["a", "b", "c"]), "prompt"),
    ]
    for body, param in cases:
        with pytest.raises(InvalidRequestError) as raised:
            check_request_limits(body, limits)
        assert raised.value.param == param
    check_request_limits(CompletionRequest(model="m", prompt=list(range(100))), limits)  # one prompt of token ids


def test_fingerprint_changes_with_what_decides_the_tokens(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    weights = model_dir / "model.safetensors"
    weights.write_bytes(b"\0" * 64)
    settings = Settings(data_dir=tmp_path, model_path=model_dir)
    base = system_fingerprint(settings, "smol", None)
    assert base == system_fingerprint(settings, "smol", None)
    assert base.startswith("fp_") and len(base) == 15
    assert system_fingerprint(settings, "smol", "adp_1") != base
    assert system_fingerprint(settings, "other", None) != base
    assert _fingerprint("9.9.9", "smol", weights_identity(model_dir, tmp_path), "") != base
    identity = weights_identity(model_dir, tmp_path)
    weights.write_bytes(b"\1" * 65)
    os.utime(weights, ns=(1, 1))
    weights_identity.cache_clear()
    assert weights_identity(model_dir, tmp_path) != identity


def test_only_a_spent_budget_says_do_not_retry() -> None:
    assert retry_headers("insufficient_quota") == {"x-should-retry": "false"}
    assert retry_headers("rate_limit_exceeded") == {} and retry_headers(None) == {}


def test_cors_origins_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CORS_ALLOWED_ORIGINS", "https://a.example, https://b.example")
    assert Settings().cors_allowed_origins == ["https://a.example", "https://b.example"]
    monkeypatch.setenv("LORAPLEX_CORS_ALLOWED_ORIGINS", '["https://c.example"]')
    assert Settings().cors_allowed_origins == ["https://c.example"]
    monkeypatch.delenv("LORAPLEX_CORS_ALLOWED_ORIGINS")
    assert Settings().cors_allowed_origins == []
