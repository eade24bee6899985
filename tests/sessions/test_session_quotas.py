"""A tenant's sessions are capped in bytes (each one's, and the sum of the tenant's), on Redis and in-process, and
through the API: a session's tool_choice is bounded like its tools, a turn that would grow a session past its cap is
refused before it runs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from loraplex.platform.errors import status_for
from loraplex.sessions.errors import StoredStateLimitError, StoredStateTooLargeError
from loraplex.sessions.quota import StoreQuota
from loraplex.sessions.store import SessionRecord, TurnResult, new_session_id
from waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"


def _record(tenant: str, *, system: str = "", ttl: int = 3600) -> SessionRecord:
    return SessionRecord(id=new_session_id(), tenant_id=tenant, model="smollm2", system=system, ttl_seconds=ttl)


def _size(record: SessionRecord) -> int:
    return len(record.to_json().encode())


def test_a_tenants_session_bytes_are_counted_through_create_turns_delete_and_expiry(store: Any) -> None:
    quota = StoreQuota(what="sessions", max_bytes=5000, max_record_bytes=3000, max_bytes_setting="bytes_cap",
                       max_record_bytes_setting="record_cap")
    first = store.create(_record("ten_q", system="a" * 1000), quota=quota)
    assert store.bytes_of("ten_q") == _size(first)
    with pytest.raises(StoredStateTooLargeError, match="record_cap") as too_large:
        store.create(_record("ten_q", system="a" * 3500), quota=quota)
    assert status_for(too_large.value) == 400
    second = store.create(_record("ten_q", system="b" * 1500), quota=quota)
    lease = store.begin_turn("ten_q", second.id)
    updated = store.complete_turn(lease, TurnResult(
        new_messages=[{"role": "user", "content": "c" * 1000}, {"role": "assistant", "content": "ok"}],
        prefix_token_ids=[1, 2, 3], prompt_tokens=3, cached_tokens=0))
    total = _size(first) + _size(updated)
    assert store.bytes_of("ten_q") == total and total > 3000
    with pytest.raises(StoredStateLimitError, match="bytes_cap") as full:
        store.create(_record("ten_q", system="d" * 1800), quota=quota)
    assert status_for(full.value) == 429
    store.create(_record("ten_other", system="d" * 1800), quota=quota)  # another tenant's bytes are its own
    store.delete("ten_q", second.id)
    assert store.bytes_of("ten_q") == _size(first)
    short = store.create(_record("ten_q", ttl=1), quota=quota)
    assert store.bytes_of("ten_q") == _size(first) + _size(short)

    def swept() -> bool:
        store.pop_expired()  # what the sweeper does
        return store.bytes_of("ten_q") == _size(first)

    wait_until(swept, timeout_s=10, interval_s=0.2, what="the expired session's bytes to leave the tenant's total")


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    with start_server(max_session_bytes=4096, max_session_bytes_per_tenant=12_000,
                      grammar_max_spec_bytes=2048) as running:
        yield running


def _post(server: Any, path: str, body: dict[str, Any], label: str = "all") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers={"Authorization": f"Bearer {server.keys[label]}"},
                      timeout=120)


def test_a_sessions_tool_choice_is_bounded(server: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    choice = {"type": "function", "function": {"name": "f"}, "padding": "p" * 5000}
    answer = _post(server, "/v1/sessions", {"model": MODEL, "tools": tools, "tool_choice": choice})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "tool_choice"


def test_a_turn_that_would_outgrow_its_session_is_refused_before_it_runs(server: Any) -> None:
    session = _post(server, "/v1/sessions", {"model": MODEL}).json()
    chat = {"model": MODEL, "session_id": session["id"], "max_tokens": 1}
    ok = _post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "a" * 800}]})
    assert ok.status_code == 200, ok.text
    refused = _post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "b" * 3000}]})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "stored_state_too_large"
    assert "max_session_bytes" in refused.json()["error"]["message"]
    # The refused turn gave its lease back: a small one runs.
    again = _post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "c"}]})
    assert again.status_code == 200, again.text


def test_a_tenant_past_its_session_bytes_gets_a_429(server: Any) -> None:
    made = []
    while True:
        answer = _post(server, "/v1/sessions", {"model": MODEL, "system": "s" * 3000})
        if answer.status_code != 200:
            break
        made.append(answer.json()["id"])
        assert len(made) < 10
    assert answer.status_code == 429, answer.text
    assert "max_session_bytes_per_tenant" in answer.json()["error"]["message"]
    assert _post(server, "/v1/sessions", {"model": MODEL, "system": "s" * 3000}, label="globex").status_code == 200
    httpx.delete(f"{server.base_url}/v1/sessions/{made[0]}", headers={"Authorization": f"Bearer {server.keys['all']}"})
    assert _post(server, "/v1/sessions", {"model": MODEL, "system": "s" * 3000}).status_code == 200
