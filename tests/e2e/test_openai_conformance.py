"""OpenAI conformance through the official `openai` SDK against a real server (SmolLM2 on the CPU).

Context overflow as OpenAI reports it, parameters we cannot honour refused by
name, request limits, `system_fingerprint`, `reasoning_effort` none/minimal,
no SDK retries on a spent budget, the `user` field in usage reports, SSE
keep-alives while a stream waits, and CORS for browser apps.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

import httpx
import openai
import pytest
from e2e_helpers import HELLO, MODEL, auth
from waiting import wait_for_fresh_rate_window

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(start_server):  # type: ignore[no-untyped-def]
    """Its own server: tiny keep-alive interval, CORS on, and budgets that must not leak into shared servers."""
    with start_server(sse_keepalive_s=0.05, cors_allowed_origins=[ORIGIN]) as running:
        yield running


def _refused(call: Any, status: int, *, code: str, param: str) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    error = raised.value
    assert error.status_code == status, error.body
    assert error.code == code and error.param == param, error.body
    assert error.message
    return error


# ---- context length ---------------------------------------------------------------------------

def test_context_overflow_is_400_context_length_exceeded(openai_client) -> None:  # type: ignore[no-untyped-def]
    long_text = "hello " * 2500  # > max_model_len (2048) tokens
    error = _refused(lambda: openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=1),
        400, code="context_length_exceeded", param="messages")
    assert isinstance(error, openai.BadRequestError) and "maximum context length" in error.message
    _refused(lambda: openai_client.completions.create(model=MODEL, prompt=long_text, max_tokens=1),
             400, code="context_length_exceeded", param="prompt")


# ---- parameters: supported, harmless, refused ----------------------------------------------------

@pytest.mark.parametrize(("kwargs", "param"), [
    ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"prediction": {"type": "content", "content": "Red, green, blue."}}, "prediction"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
])
def test_parameters_we_cannot_honour_are_refused_by_name(openai_client, kwargs, param) -> None:  # type: ignore[no-untyped-def]
    _refused(lambda: openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **kwargs),
             400, code="unsupported_parameter", param=param)


def test_unknown_fields_are_refused_on_both_endpoints(openai_client) -> None:  # type: ignore[no-untyped-def]
    error = _refused(lambda: openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2, extra_body={"frobnicate": 1}),
        400, code="unknown_parameter", param="frobnicate")
    assert "frobnicate" in error.message
    _refused(lambda: openai_client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"tools": []}), 400, code="unknown_parameter", param="tools")


def test_harmless_parameters_are_accepted(openai_client) -> None:  # type: ignore[no-untyped-def]
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2, temperature=0, store=False, metadata={"team": "search"},
        service_tier="default", prompt_cache_key="tenant-cache", safety_identifier="user-123", user="user-123",
        modalities=["text"], parallel_tool_calls=True,
    )
    assert reply.choices[0].message.content
    completion = openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0,
                                                   user="user-123")
    assert completion.choices[0].text


def test_reasoning_effort_none_and_minimal(openai_client) -> None:  # type: ignore[no-untyped-def]
    for effort in ("none", "minimal", "low"):
        reply = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0,
                                                      reasoning_effort=effort)
        assert reply.choices[0].message.content is not None
    none = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, reasoning_effort="none")
    assert none.usage.completion_tokens_details.reasoning_tokens == 0
    _refused(lambda: openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                                           reasoning_effort="xhigh"),
             400, code="invalid_value", param="reasoning_effort")


# ---- limits ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "param"), [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),                       # OpenAI allows 4
    ({"stop": ["x" * 257]}, "stop"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),      # OpenAI allows 300
    ({"n": 17}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}] * 2049}, "messages"),
    ({"extra_body": {"stop_token_ids": list(range(65))}}, "stop_token_ids"),
])
def test_chat_limits_name_the_parameter(openai_client, kwargs, param) -> None:  # type: ignore[no-untyped-def]
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 1, **kwargs}
    _refused(lambda: openai_client.chat.completions.create(**request), 400, code="invalid_request", param=param)


def test_prompt_list_limit(openai_client) -> None:  # type: ignore[no-untyped-def]
    _refused(lambda: openai_client.completions.create(model=MODEL, prompt=["hi"] * 257, max_tokens=1),
             400, code="invalid_request", param="prompt")
    at_limit = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1,
                                                     stop=["a", "b", "c", "d"], logit_bias={"5": 1})
    assert at_limit.choices


# ---- system_fingerprint ------------------------------------------------------------------------

def test_system_fingerprint_on_every_response_and_chunk(openai_client) -> None:  # type: ignore[no-untyped-def]
    chat = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    fingerprint = chat.system_fingerprint
    assert re.fullmatch(r"fp_[0-9a-f]{12}", fingerprint or "")
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks and {c.system_fingerprint for c in chunks} == {fingerprint}
    completion = openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert completion.system_fingerprint == fingerprint
    streamed = list(openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True))
    assert streamed and {c.system_fingerprint for c in streamed} == {fingerprint}


# ---- spent budget: no retries --------------------------------------------------------------------

def test_spent_budget_is_429_the_sdk_does_not_retry(server) -> None:  # type: ignore[no-untyped-def]
    put = httpx.put(f"{server.base_url}/v1/admin/tenants/globex/budgets", json={"monthly_token_limit": 40},
                    headers=auth(server.keys["admin"]))
    assert put.status_code == 200, put.text
    attempts: list[str] = []
    client = openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=server.keys["globex"], max_retries=2,
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [lambda request: attempts.append(request.url)]}),
    )
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30, extra_body={"ignore_eos": True})
    meter = next(r.meter for r in server.services.extensions.usage_recorders if hasattr(r, "meter"))
    assert meter.wait_written()
    attempts.clear()
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    assert raised.value.code == "insufficient_quota"
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert len(attempts) == 1, "the SDK retried a request that no retry can help"
    assert time.monotonic() - started < 5  # no backoff sleeps either


def test_rate_limit_429_still_invites_a_retry(server) -> None:  # type: ignore[no-untyped-def]
    created = httpx.post(f"{server.base_url}/v1/admin/tenants/acme/keys", json={"scopes": ["inference"], "rpm_limit": 1},
                         headers=auth(server.keys["admin"]))
    key = created.json()["key"]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    wait_for_fresh_rate_window()
    assert httpx.post(f"{server.base_url}/v1/completions", json=body, headers=auth(key), timeout=60).status_code == 200
    limited = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=auth(key), timeout=60)
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert "x-should-retry" not in limited.headers and int(limited.headers["retry-after"]) >= 1


# ---- the user field in usage ---------------------------------------------------------------------

def test_user_is_stored_and_grouped_in_usage(server) -> None:  # type: ignore[no-untyped-def]
    client = server.client("all")
    alice, bob = f"alice-{secrets.token_hex(3)}", f"bob-{secrets.token_hex(3)}"
    for user in (alice, alice, bob):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, user=user)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, user=bob)
    meter = next(r.meter for r in server.services.extensions.usage_recorders if hasattr(r, "meter"))
    assert meter.wait_written()
    headers = auth(server.keys["all"])
    report = httpx.get(f"{server.base_url}/v1/usage", params={"group_by": "user"}, headers=headers, timeout=30)
    assert report.status_code == 200, report.text
    by_user = {row["user"]: row for row in report.json()["data"]}
    assert by_user[alice]["requests"] == 2 and by_user[bob]["requests"] == 2
    assert by_user[alice]["input_tokens"] > 0 and report.json()["group_by"] == ["user"]
    both = httpx.get(f"{server.base_url}/v1/usage", params={"group_by": "user,model"}, headers=headers, timeout=30)
    assert {(r["user"], r["model"]) for r in both.json()["data"]} >= {(alice, MODEL), (bob, MODEL)}
    csv_text = httpx.get(f"{server.base_url}/v1/usage", params={"group_by": "user", "format": "csv"},
                         headers=headers, timeout=30).text
    assert csv_text.splitlines()[0].startswith("user,") and alice in csv_text
    log = httpx.get(f"{server.base_url}/v1/usage/requests", params={"user": alice}, headers=headers, timeout=30)
    rows = log.json()["data"]
    assert len(rows) == 2 and {row["user"] for row in rows} == {alice} and log.json()["totals"]["requests"] == 2


def test_user_longer_than_the_limit_is_refused(openai_client) -> None:  # type: ignore[no-untyped-def]
    _refused(lambda: openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, user="u" * 257),
             400, code="invalid_value", param="user")


# ---- SSE keep-alive ------------------------------------------------------------------------------

def _long_prompt() -> str:
    """~1,500 tokens that no earlier request shares (so the prefix cache cannot make the first token quick)."""
    return secrets.token_hex(8) + " " + " ".join(f"word{secrets.randbelow(10_000)}" for _ in range(250))


def test_stream_sends_keepalive_comments_while_waiting_for_its_first_token(server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "prompt": _long_prompt(), "max_tokens": 3, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=auth(server.keys["all"]),
                      timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data >= 1 and all(line == ": keep-alive" for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"
    assert not any(line.startswith(":") for line in lines[first_data:])  # only while waiting


def test_sdk_streams_through_keepalives(server) -> None:  # type: ignore[no-untyped-def]
    client = server.client("all")
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": _long_prompt()}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


# ---- CORS ----------------------------------------------------------------------------------------

def test_cors_preflight_and_response_headers_for_allowed_origins(server) -> None:  # type: ignore[no-untyped-def]
    preflight = httpx.options(f"{server.base_url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": MODEL, "messages": HELLO,
                        "max_tokens": 1}, headers={**auth(server.keys["all"]), "Origin": ORIGIN}, timeout=60)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in answer.headers["access-control-expose-headers"]
    other = httpx.options(f"{server.base_url}/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def test_cors_is_off_by_default(api_server) -> None:  # type: ignore[no-untyped-def]
    preflight = httpx.options(f"{api_server.base_url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    answer = httpx.get(f"{api_server.base_url}/v1/models", headers={**auth(api_server.keys["all"]), "Origin": ORIGIN})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
