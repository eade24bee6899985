"""Affinity headers on one server: a session named by `x-session-id`, the key coming back on every session
response, `x-session-token` echoed, and a turn whose KV another replica holds counted as moved."""

from __future__ import annotations

from typing import Any

import httpx
from loraplex.sessions.store import TurnResult
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"


def auth(server: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.keys['all']}"}


def chat(server: Any, content: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
               "temperature": 0, **body}
    return httpx.post(server.base_url + "/v1/chat/completions", json=payload,
                      headers={**auth(server), **(headers or {})}, timeout=120)


def moved_turns(server: Any) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "loraplex_session_turns_moved")
    return next(s.value for s in family.samples if s.name == "loraplex_session_turns_moved_total")


def test_the_session_header_names_the_session_and_comes_back(api_server: Any) -> None:
    created = httpx.post(api_server.base_url + "/v1/sessions", json={"model": MODEL}, headers=auth(api_server))
    session_id = created.json()["id"]
    assert created.headers["x-session-id"] == session_id     # a balancer can learn the key from the creation

    first = chat(api_server, "Hi, I am Ada.", {"x-session-id": session_id, "x-session-token": "pod-a"})
    assert first.status_code == 200, first.text
    assert first.headers["x-session-id"] == session_id and first.headers["x-session-token"] == "pod-a"
    second = chat(api_server, "What is my name?", {"x-session-id": session_id})
    assert second.status_code == 200 and second.headers["x-session-id"] == session_id
    assert "x-session-token" not in second.headers
    # the header made them turns of the session: the second was served from the first's pinned KV
    record = httpx.get(f"{api_server.base_url}/v1/sessions/{session_id}", headers=auth(api_server)).json()
    assert record["num_turns"] == 2
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= first.json()["usage"]["prompt_tokens"] - 16

    with httpx.stream("POST", api_server.base_url + "/v1/chat/completions", timeout=120,
                      headers={**auth(api_server), "x-session-id": session_id},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Bye"}], "max_tokens": 2,
                            "stream": True}) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-session-id"] == session_id
        assert "data: [DONE]" in streamed.read().decode()

    conflict = chat(api_server, "Hi", {"x-session-id": session_id}, session_id="sess_000000000000000000000000")
    assert conflict.status_code == 400 and conflict.json()["error"]["param"] == "session_id"


def test_a_routing_key_of_the_clients_own_is_echoed_not_taken_for_a_session(api_server: Any) -> None:
    plain = chat(api_server, "Hi", {"x-session-id": "user-42", "x-session-token": "t0k"})
    assert plain.status_code == 200, plain.text
    assert (plain.headers["x-session-id"], plain.headers["x-session-token"]) == ("user-42", "t0k")
    assert "x-session-id" not in chat(api_server, "Hi").headers  # no session, no key: nothing to stick to


def test_a_turn_whose_kv_another_replica_holds_is_counted_as_moved(api_server: Any) -> None:
    session_id = httpx.post(api_server.base_url + "/v1/sessions", json={"model": MODEL},
                            headers=auth(api_server)).json()["id"]
    assert chat(api_server, "Hello", session_id=session_id).status_code == 200
    before = moved_turns(api_server)
    assert chat(api_server, "Again", session_id=session_id).status_code == 200
    assert moved_turns(api_server) == before  # same replica: not moved

    # Another replica ran the last turn (as its store write says): the next one here re-prefills, counted.
    store = api_server.services.extensions.domain_state["sessions"].store
    tenant_id = api_server.tenants["acme"]
    lease = store.begin_turn(tenant_id, session_id)
    store.complete_turn(lease, TurnResult(new_messages=[], prefix_token_ids=[1, 2, 3], prompt_tokens=3,
                                          cached_tokens=0, replica_id="another-replica"))
    again = chat(api_server, "Still there?", session_id=session_id)
    assert again.status_code == 200, again.text
    assert moved_turns(api_server) == before + 1


def respond(server: Any, text: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/responses", headers={**auth(server), **(headers or {})}, timeout=120,
                      json={"model": MODEL, "input": text, "max_output_tokens": 4, "temperature": 0, **body})


def test_a_responses_chain_is_keyed_by_its_first_response(api_server: Any) -> None:
    first = respond(api_server, "My name is Ada.")
    assert first.status_code == 200, first.text
    root = first.json()["id"]
    assert first.headers["x-session-id"] == root
    # the previous response named by a header, then by the body: the key stays the chain's first response
    second = respond(api_server, "What is my name?", {"x-previous-response-id": root})
    assert second.status_code == 200, second.text
    assert second.json()["previous_response_id"] == root and second.headers["x-session-id"] == root
    assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    third = respond(api_server, "Thanks.", previous_response_id=second.json()["id"])
    assert third.headers["x-session-id"] == root
    conflict = respond(api_server, "Hi", {"x-previous-response-id": root}, previous_response_id=third.json()["id"])
    assert conflict.status_code == 400 and conflict.json()["error"]["param"] == "previous_response_id"


def test_a_continuation_whose_kv_another_replica_holds_is_counted_as_moved(api_server: Any) -> None:
    first = respond(api_server, "Hello there.").json()
    before = moved_turns(api_server)
    assert respond(api_server, "Again.", previous_response_id=first["id"]).status_code == 200
    assert moved_turns(api_server) == before
    chains = api_server.services.extensions.domain_state["responses"]
    record = chains.store.get(api_server.tenants["acme"], first["id"])
    record.replica_id = "another-replica"  # as if another replica had answered it
    chains.store.put(record)
    assert respond(api_server, "Still there?", previous_response_id=first["id"]).status_code == 200
    assert moved_turns(api_server) == before + 1
