"""Every error status the API promises, triggered for real, with the OpenAI error body checked."""

from __future__ import annotations

import httpx
import openai
import pytest
from e2e_helpers import MODEL, assert_openai_error, auth, chat_body, post
from waiting import wait_for_fresh_rate_window, wait_until


def test_wrong_type_is_400_naming_the_field(api_server) -> None:  # type: ignore[no-untyped-def]
    key = api_server.keys["inference"]
    r = post(api_server, "/v1/chat/completions", chat_body(temperature="hot"), key)
    assert_openai_error(r, 400, param="temperature")
    r = post(api_server, "/v1/chat/completions", chat_body(messages=[{"role": "wizard", "content": "x"}]), key)
    assert_openai_error(r, 400, param="messages[0].role")
    # As OpenAI's API: only an assistant message (calling tools) may leave its content out, and a tool message
    # names the call it answers.
    r = post(api_server, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": None}]), key)
    assert_openai_error(r, 400, param="messages[0].content")
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answered = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "42"}]
    r = post(api_server, "/v1/chat/completions", chat_body(messages=answered), key)
    assert_openai_error(r, 400, param="messages[2].tool_call_id")
    answered[2]["tool_call_id"] = "call_1"
    assert post(api_server, "/v1/chat/completions", chat_body(messages=answered, max_tokens=1), key).status_code == 200
    r = post(api_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, key)
    assert_openai_error(r, 400, param="max_tokens")
    r = post(api_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, key)
    assert_openai_error(r, 400, param="model")
    # Strings and numbers are not read as booleans, nor strings and booleans as numbers (lax parsing would stream,
    # or fix a seed, on a client's typo).
    r = post(api_server, "/v1/chat/completions", chat_body(stream="yes"), key)
    assert_openai_error(r, 400, param="stream")
    r = post(api_server, "/v1/chat/completions", chat_body(seed="1"), key)
    assert_openai_error(r, 400, param="seed")
    r = post(api_server, "/v1/chat/completions", chat_body(stream_options={"include_usage": 1}), key)
    assert_openai_error(r, 400, param="stream_options.include_usage")
    r = post(api_server, "/v1/responses", {"model": MODEL, "input": "hi", "stream": "true"}, key)
    assert_openai_error(r, 400, param="stream")
    # A query parameter is named as the client wrote it, not with FastAPI's `query.` prefix.
    r = httpx.get(api_server.base_url + "/v1/files?limit=abc", headers=auth(key), timeout=30)
    error = assert_openai_error(r, 400, param="limit")
    assert error["message"].startswith("limit: ")


def test_out_of_range_values_are_400(api_server) -> None:  # type: ignore[no-untyped-def]
    key = api_server.keys["inference"]
    assert_openai_error(post(api_server, "/v1/chat/completions", chat_body(top_p=3.0), key), 400, param="top_p")
    assert_openai_error(post(api_server, "/v1/chat/completions", chat_body(n=0), key), 400, param="n")
    assert_openai_error(post(api_server, "/v1/chat/completions", chat_body(max_tokens=0), key), 400, param="max_tokens")
    r = post(api_server, "/v1/chat/completions", chat_body(top_logprobs=30, logprobs=True), key)
    assert_openai_error(r, 400, param="top_logprobs")
    # The token limit is named as the client sent it, past int32 and past the context alike.
    for limit, code in ((2**63, "invalid_request"), (5000, "context_length_exceeded")):
        r = post(api_server, "/v1/chat/completions", chat_body(max_completion_tokens=limit), key)
        error = assert_openai_error(r, 400, code=code, param="max_completion_tokens")
        assert "max_completion_tokens" in error["message"] and "max_tokens" not in error["message"]


def test_invalid_json_is_400(api_server) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(
        api_server.base_url + "/v1/chat/completions", content=b"{not json",
        headers={**auth(api_server.keys["inference"]), "content-type": "application/json"},
    )
    assert_openai_error(r, 400)


def test_unknown_model_is_404(api_server, openai_client) -> None:  # type: ignore[no-untyped-def]
    r = post(api_server, "/v1/chat/completions", chat_body(model="gpt-9"), api_server.keys["inference"])
    assert_openai_error(r, 404, code="model_not_found", param="model")
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)


def test_prompt_too_long_is_400_context_length_exceeded(api_server) -> None:  # type: ignore[no-untyped-def]
    long_prompt = "hello " * 2500  # > max_model_len (2048) tokens
    r = post(api_server, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 1},
             api_server.keys["inference"])
    assert_openai_error(r, 400, code="context_length_exceeded", param="prompt")
    r = post(api_server, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 5000},
             api_server.keys["inference"])
    assert_openai_error(r, 400, code="context_length_exceeded", param="max_tokens")


def _key_with_limits(server, **limits: int) -> str:  # type: ignore[no-untyped-def]
    created = httpx.post(
        f"{server.base_url}/v1/admin/tenants/acme/keys", json={"scopes": ["inference"], **limits},
        headers=auth(server.keys["admin"]),
    )
    assert created.status_code == 201, created.text
    return created.json()["key"]


def test_requests_per_minute_is_429_with_retry_after(api_server) -> None:  # type: ignore[no-untyped-def]
    key = _key_with_limits(api_server, rpm_limit=2)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    wait_for_fresh_rate_window()
    assert post(api_server, "/v1/completions", body, key).status_code == 200
    assert post(api_server, "/v1/completions", body, key).status_code == 200
    r = post(api_server, "/v1/completions", body, key)
    error = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert error["type"] == "rate_limit_error"
    assert 60 >= int(r.headers["retry-after"]) >= 1


def test_tokens_per_minute_is_429(api_server) -> None:  # type: ignore[no-untyped-def]
    # Prompt (5) and completion (20) tokens count; the next prompt would take the minute to 30 > 28.
    key = _key_with_limits(api_server, tpm_limit=28)
    body = {"model": MODEL, "prompt": "one two three four five", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    wait_for_fresh_rate_window()
    first = post(api_server, "/v1/completions", body, key)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] == 25
    r = post(api_server, "/v1/completions", body, key)
    assert_openai_error(r, 429, code="tokens_rate_limit_exceeded")
    assert int(r.headers["retry-after"]) >= 1


def test_admission_places_are_shared_fairly_between_tenants(start_server) -> None:  # type: ignore[no-untyped-def]
    """One tenant holding every place gets a 429 naming its share; another tenant still gets in."""
    with start_server(max_pending_requests=1) as server:
        key = server.keys["inference"]
        long_body = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=long_body, headers=auth(key), timeout=120) as s:
            assert s.status_code == 200
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")  # the first request is now generating
            r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}, key)
            assert_openai_error(r, 429, code="tenant_share_exceeded")
            assert "max_pending_requests" in r.json()["error"]["message"]
            other = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                         server.keys["globex"])
            assert other.status_code == 200, other.text
        # the server notices the closed stream asynchronously; once it has, service resumes
        def served() -> int | None:
            status = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                          key).status_code
            return None if status == 429 else status

        assert wait_until(served, timeout_s=15, interval_s=0.2, what="the closed stream's place to be freed") == 200
