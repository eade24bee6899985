"""Sessions through the real server and the openai client (SmolLM2, greedy)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the engine's KV block: pinned KV covers whole blocks only
QUESTIONS = [
    "My name is Ada. Remember it.", "What is 2 plus 3?", "Name a colour of the sky.", "What is my name?",
    "Say a word that rhymes with cat.", "Which is bigger, 7 or 9?", "Name a fruit.", "What is the capital of France?",
    "Count from one to three.", "Say goodbye.",
]


@pytest.fixture(scope="module", params=["memory", "redis"])
def server(request, start_server, redis_url, redis_prefix):
    overrides = {"session_sweep_interval_s": 0.2, "session_busy_wait_s": 0.5}
    if request.param == "redis":
        overrides |= {"redis_url": redis_url, "redis_key_prefix": f"{redis_prefix}sess:"}
    with start_server(**overrides) as running:
        yield running


def _auth(server, label: str = "all") -> dict[str, str]:
    return {"Authorization": f"Bearer {server.keys[label]}"}


def _create(server, label: str = "all", **body) -> dict:
    response = httpx.post(f"{server.base_url}/v1/sessions", json={"model": MODEL, **body},
                          headers=_auth(server, label), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _engine_pins(server) -> dict:
    return server.services.engine.engine.block_manager.pins


def test_ten_turn_session_equals_stateless_and_prefills_only_new_tokens(server):
    client = server.client("all")
    stateless = server.client("globex")  # another tenant: its prefix cache can never serve the session
    system = "You are a terse assistant."
    session = _create(server, system=system)
    history = [{"role": "system", "content": system}]
    previous_total = None
    for turn, question in enumerate(QUESTIONS, start=1):
        user = {"role": "user", "content": question}
        answer = client.chat.completions.create(
            model=MODEL, messages=[user], max_tokens=12, temperature=0, extra_body={"session_id": session["id"]},
        )
        reference = stateless.chat.completions.create(
            model=MODEL, messages=[*history, user], max_tokens=12, temperature=0,
        )
        assert answer.choices[0].message.content == reference.choices[0].message.content, f"turn {turn}"
        assert answer.usage.prompt_tokens == reference.usage.prompt_tokens
        usage = answer.usage
        prefilled = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
        if previous_total is not None:
            new_tokens = usage.prompt_tokens - previous_total
            # Only the new tokens, plus the tail of the last partly filled block (pins hold whole blocks).
            assert new_tokens <= prefilled <= new_tokens + BLOCK_SIZE, (turn, prefilled, new_tokens)
        previous_total = usage.prompt_tokens + usage.completion_tokens
        history += [user, {"role": "assistant", "content": answer.choices[0].message.content}]
    got = httpx.get(f"{server.base_url}/v1/sessions/{session['id']}", headers=_auth(server), timeout=30).json()
    assert got["num_turns"] == 10 and got["kv_state"] == "pinned"
    assert got["messages"] == history[1:]
    assert got["last_turn"]["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert session["id"] in _engine_pins(server)


def test_streamed_turn_is_recorded(server):
    client = server.client("all")
    session = _create(server)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=6, temperature=0, stream=True,
        extra_body={"session_id": session["id"]},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    got = _session_at_version(server, session["id"], 1)
    assert got["messages"] == [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": text}]


def test_concurrent_turn_gets_409_and_transcript_stays_consistent(server):
    client = server.client("all")
    session = _create(server)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=120,
        temperature=0, stream=True, extra_body={"session_id": session["id"], "ignore_eos": True},
    )
    first = next(iter(stream))  # the turn is running
    with pytest.raises(openai.ConflictError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Interrupt!"}],
                                       max_tokens=4, extra_body={"session_id": session["id"]})
    assert raised.value.body["code"] == "session_busy"
    rest = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    text = (first.choices[0].delta.content or "") + rest
    got = _session_at_version(server, session["id"], 1)
    time.sleep(0.3)
    assert _session_at_version(server, session["id"], 1)["version"] == 1, "the refused turn recorded nothing"
    assert got["messages"] == [{"role": "user", "content": "Tell me a long story."},
                               {"role": "assistant", "content": text}]


def test_refused_turn_frees_the_session(server):
    client = server.client("all")
    session = _create(server)
    with pytest.raises(openai.APIStatusError) as raised:  # 400: can never fit, refused before the engine
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=100_000, extra_body={"session_id": session["id"]})
    assert raised.value.status_code == 400
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=3, temperature=0, extra_body={"session_id": session["id"]})
    assert answer.choices[0].message.content is not None


def test_other_tenant_gets_404_on_every_route(server):
    session = _create(server)
    other = _auth(server, "globex")
    base = f"{server.base_url}/v1/sessions/{session['id']}"
    assert httpx.get(base, headers=other, timeout=30).status_code == 404
    assert httpx.delete(base, headers=other, timeout=30).status_code == 404
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", headers=other, timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "session_id": session["id"]})
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "session_not_found"
    listed = httpx.get(f"{server.base_url}/v1/sessions", headers=other, timeout=30).json()
    assert session["id"] not in [s["id"] for s in listed["data"]]
    assert httpx.get(base, headers=_auth(server), timeout=30).status_code == 200


def test_list_is_paginated(server):
    ids = [_create(server, "globex")["id"] for _ in range(5)]
    seen, after = [], None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = httpx.get(f"{server.base_url}/v1/sessions", params=params, headers=_auth(server, "globex"),
                         timeout=30).json()
        seen += [s["id"] for s in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert set(ids) <= set(seen) and len(seen) == len(set(seen))


def test_delete_and_ttl_expiry_release_pinned_blocks(server):
    client = server.client("all")
    engine = server.services.engine
    deleted = _create(server)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to twenty."}],
                                   max_tokens=24, temperature=0, extra_body={"session_id": deleted["id"]})
    expiring = _create(server, ttl_seconds=2)
    for session in (expiring,):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to twenty."}],
                                       max_tokens=24, temperature=0, extra_body={"session_id": session["id"]})
    pins = _engine_pins(server)
    assert deleted["id"] in pins and expiring["id"] in pins, (list(pins), deleted["id"], expiring["id"])
    pinned_before = engine.stats()["num_blocks_pinned"]
    response = httpx.delete(f"{server.base_url}/v1/sessions/{deleted['id']}", headers=_auth(server), timeout=30)
    assert response.json() == {"id": deleted["id"], "object": "session.deleted", "deleted": True}
    wait_until(lambda: deleted["id"] not in _engine_pins(server), timeout_s=5, interval_s=0.05,
               what="the deleted session's pin to go")
    # TTL 2 s, swept every 0.2 s
    wait_until(lambda: expiring["id"] not in _engine_pins(server), timeout_s=15, interval_s=0.05,
               what="the expired session's pin to go")
    wait_until(lambda: engine.stats()["num_blocks_pinned"] < pinned_before, timeout_s=5, interval_s=0.05,
               what=lambda: f"fewer pinned blocks than {pinned_before}: {engine.stats()}")
    for session in (deleted, expiring):
        with pytest.raises(openai.NotFoundError) as raised:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={"session_id": session["id"]})
        assert "was not found" in raised.value.body["message"]


def test_bad_session_requests_are_typed_errors(server):
    session = _create(server)
    headers = _auth(server)
    bad_ttl = httpx.post(f"{server.base_url}/v1/sessions", json={"model": MODEL, "ttl_seconds": 0},
                         headers=headers, timeout=30)
    assert bad_ttl.status_code == 400 and bad_ttl.json()["error"]["param"] == "ttl_seconds"
    misspelt = httpx.post(f"{server.base_url}/v1/sessions", json={"model": MODEL, "ttl": 60}, headers=headers,
                          timeout=30)
    assert misspelt.status_code == 400 and misspelt.json()["error"]["param"] == "ttl"
    unknown_model = httpx.post(f"{server.base_url}/v1/sessions", json={"model": "nope"}, headers=headers, timeout=30)
    assert unknown_model.status_code == 404
    two_choices = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "session_id": session["id"]})
    assert two_choices.status_code == 400 and two_choices.json()["error"]["param"] == "n"
    completions = httpx.post(f"{server.base_url}/v1/completions", headers=headers, timeout=30, json={
        "model": MODEL, "prompt": "hi", "session_id": session["id"]})
    assert completions.status_code in (200, 400)  # /v1/completions ignores unknown fields (no session_id there)


def _session_at_version(server, session_id: str, version: int) -> dict:
    """A streamed turn is recorded just after its last chunk: poll briefly for it."""
    url = f"{server.base_url}/v1/sessions/{session_id}"

    def recorded() -> dict | None:
        got = httpx.get(url, headers=_auth(server), timeout=30).json()
        return got if got["version"] >= version else None

    return wait_until(recorded, timeout_s=20, interval_s=0.05, what=f"session {session_id} at version {version}")


def test_session_lost_by_the_store_is_a_clear_404_and_metrics_are_exported(server):
    session = _create(server)
    if server.settings.redis_url:  # Redis lost the key (say, restarted without persistence)
        import redis

        client = redis.Redis.from_url(server.settings.redis_url)
        client.delete(f"{server.settings.redis_key_prefix}session:{session['id']}")
        client.close()
    else:
        server.services.extensions.domain_state["sessions"].store.delete(server.tenants["acme"], session["id"])
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", headers=_auth(server), timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "session_id": session["id"]})
    assert chat.status_code == 404
    assert "Create a new session" in chat.json()["error"]["message"]
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    for name in ("loraplex_sessions_pinned", "loraplex_session_turns_total", "loraplex_session_turn_cache_hit_rate",
                 "loraplex_num_session_offloads", "loraplex_num_blocks_pinned_host",
                 "loraplex_kv_blocks_pinned_by_tenant"):
        assert name in metrics, name


def test_a_stopped_server_leaves_no_pins_in_an_engine_that_outlives_it(start_server):
    with start_server() as short_lived:
        session = _create(short_lived)
        short_lived.client("all").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=8, temperature=0,
            extra_body={"session_id": session["id"]})
        pins = short_lived.services.engine.engine.block_manager.pins
        assert session["id"] in pins
    wait_until(lambda: session["id"] not in pins, timeout_s=5, interval_s=0.05, what="the session's pin to go")


def test_session_limits_are_4xx_naming_the_field(start_server):
    with start_server(max_sessions_per_tenant=2, max_session_system_chars=100, grammar_max_tools=3) as server:
        def post(label: str = "all", **body) -> httpx.Response:
            return httpx.post(f"{server.base_url}/v1/sessions", json={"model": MODEL, **body},
                              headers=_auth(server, label), timeout=30)

        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        deep: dict = {"type": "string"}
        for _ in range(400):
            deep = {"type": "array", "items": deep}
        for body, param in [({"system": "x" * 101}, "system"),
                            ({"tools": [tool] * 4}, "tools"),
                            ({"tools": [tool, tool]}, "tools"),  # duplicate names: checked at creation
                            ({"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "d", "schema": deep}}}, "response_format")]:
            reply = post(**body)
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"].startswith(param)
        first = post(system="x" * 100, tools=[tool])
        assert first.status_code == 200, first.text
        assert post().status_code == 200
        refused = post()
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "session_limit_exceeded"
        assert post("globex").status_code == 200  # another tenant's sessions are its own
        httpx.delete(f"{server.base_url}/v1/sessions/{first.json()['id']}", headers=_auth(server), timeout=30)
        assert post().status_code == 200
