"""Inputs that used to end in a 500 (or leak) now end in a 4xx naming what was wrong, through a real server on
real Redis: a far-future usage date, a session id that reaches another Redis key, a schema property name with
CR/LF, a chat template that refuses the conversation or meets a value it cannot handle, a malformed tool call of an
earlier turn, a file expiry in non-ASCII digits; and /readyz names a broken dependency without its error."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from loraplex.engine.errors import InvalidRequestError

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(start_server: Any, redis_url: str, redis_prefix: str) -> Any:
    with start_server(redis_url=redis_url, redis_key_prefix=redis_prefix + "low:") as running:
        yield running


def _auth(server: Any, label: str = "all") -> dict[str, str]:
    return {"Authorization": f"Bearer {server.keys[label]}"}


def test_usage_requests_at_the_end_of_time_is_a_400_naming_end(server: Any) -> None:
    for path in ("/v1/usage/requests", "/v1/usage"):
        answer = httpx.get(server.base_url + path, params={"start": "9999-12-31", "end": "9999-12-31"},
                           headers=_auth(server), timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "end"


def test_a_session_id_reaching_the_lease_key_is_unknown_while_a_turn_runs(server: Any) -> None:
    created = httpx.post(server.base_url + "/v1/sessions", json={"model": MODEL}, headers=_auth(server), timeout=30)
    assert created.status_code == 200, created.text
    session_id = created.json()["id"]
    store = server.services.extensions.domain_state["sessions"].store
    lease = store.begin_turn(server.tenants["acme"], session_id)  # a turn is running: its lease key exists
    try:
        for method in ("GET", "DELETE"):
            answer = httpx.request(method, f"{server.base_url}/v1/sessions/{session_id}:lease", headers=_auth(server),
                                   timeout=30)
            assert answer.status_code == 404, answer.text
            assert answer.json()["error"]["code"] == "session_not_found"
        chat = {"model": MODEL, "session_id": session_id + ":lease", "max_tokens": 1,
                "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(server.base_url + "/v1/chat/completions", json=chat, headers=_auth(server), timeout=30)
        assert answer.status_code == 404, answer.text
    finally:
        store.abort_turn(lease)
    assert httpx.get(f"{server.base_url}/v1/sessions/{session_id}", headers=_auth(server), timeout=30).status_code == 200


def test_a_relaxed_property_name_with_cr_lf_cannot_split_the_response_headers(server: Any) -> None:
    name = "a\r\nx-injected: 1"
    schema = {"type": "object", "properties": {name: {"type": "array", "items": {"type": "integer", "maximum": 9},
                                                      "uniqueItems": True}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "numbers"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": False}}}
    answer = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=_auth(server), timeout=60)
    assert answer.status_code == 200, answer.text
    relaxed = answer.headers["x-loraplex-grammar-relaxed"]
    assert "uniqueItems" in relaxed and "\r" not in relaxed and "\n" not in relaxed
    assert "x-injected" not in answer.headers


def test_readyz_names_a_broken_database_without_its_error_text(server: Any) -> None:
    from sqlalchemy import create_engine

    original = server.services.db_engine
    server.services.db_engine = create_engine("postgresql+psycopg://secret_user:hunter2@127.0.0.1:1/secret_db")
    try:
        broken = httpx.get(server.base_url + "/readyz", timeout=10)
    finally:
        server.services.db_engine.dispose()
        server.services.db_engine = original
    assert broken.status_code == 503 and set(broken.json()["not_ready"]) == {"database"}
    for secret in ("secret_user", "hunter2", "secret_db", "127.0.0.1", "OperationalError"):
        assert secret not in broken.text


def test_a_chat_template_that_raises_is_a_400_naming_messages(smollm_path: Any) -> None:
    from loraplex.platform.api.preparation import render_chat_prompt
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError) as refused:
        render_chat_prompt(tokenizer, twice, {})
    assert refused.value.param == "messages" and "alternate" in refused.value.message
    assert render_chat_prompt(tokenizer, twice[:1], {}) == list(tokenizer("a", add_special_tokens=False)["input_ids"])


def test_a_malformed_earlier_tool_call_is_a_400_naming_it(server: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    def chat(call: Any) -> httpx.Response:
        messages = [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c", "content": "r"}]
        return httpx.post(server.base_url + "/v1/chat/completions", headers=_auth(server), timeout=60,
                          json={"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 1})

    for call, param in (({"id": "c", "type": "function"}, "messages[1].tool_calls[0]"),
                        ({"id": "c", "type": "function", "function": "f"}, "messages[1].tool_calls[0]"),
                        ({"id": "c", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
                        ({"id": "c", "function": {"name": "f", "arguments": 3}},
                         "messages[1].tool_calls[0].function.arguments"),
                        ({"id": 7, "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls[0].id")):
        answer = chat(call)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param, answer.text
    # arguments as an object, as some frameworks send them, are taken and serialised
    assert chat({"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}).status_code == 200


def test_a_template_that_meets_a_value_it_cannot_handle_is_a_400_naming_messages(smollm_path: Any) -> None:
    from loraplex.platform.api.preparation import render_chat_prompt
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}"  # str + int: TypeError
    with pytest.raises(InvalidRequestError) as refused:
        render_chat_prompt(tokenizer, [{"role": "user", "content": "a"}], {})
    assert refused.value.param == "messages" and "could not render" in refused.value.message


def test_a_file_expiry_in_non_ascii_or_endless_digits_is_a_400() -> None:
    from loraplex.platform.body_limit import declared_length
    from loraplex.platform.routers.files import _expires_after

    assert _expires_after({"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"}, 60) == 7200
    for seconds in ("²", "٣٦٠٠", "9" * 5000, "-3600", ""):
        with pytest.raises(InvalidRequestError) as refused:
            _expires_after({"expires_after[anchor]": "created_at", "expires_after[seconds]": seconds}, 60)
        assert refused.value.param == "expires_after.seconds"
    assert [declared_length(v) for v in ("12", b"12", "²", "9" * 5000, "", None)] == [12, 12, None, None, None, None]


def test_tenant_text_in_a_cli_table_is_never_terminal_markup(monkeypatch: pytest.MonkeyPatch) -> None:
    # an end user named "[/x]" crashed `loraplex usage report --group-by user` on a terminal (MarkupError)
    from loraplex.platform.cli import common
    from rich.console import Console

    terminal = Console(force_terminal=True, record=True, width=200)
    monkeypatch.setattr(common, "console", terminal)
    common.print_table(["user", "requests"], [["[/x]", "1"], ["[link=http://e]click[/link]", "2"]])
    shown = terminal.export_text()
    assert "[/x]" in shown and "[link=http://e]click[/link]" in shown
