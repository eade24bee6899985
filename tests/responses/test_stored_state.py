"""Stored responses under quotas: per-tenant count and bytes, per-record size, the caller's own strings bounded
and never kept beyond the fields they belong to, pins released with what they pin, truncation that tokenizes the
history once and counts what it read, /v1/responses refused before work. Stores: real Redis and in-process."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from loraplex.platform.api.preparation import render_chat_prompt
from loraplex.platform.responses.truncation import turn_costs
from loraplex.sessions.errors import StoredStateLimitError, StoredStateTooLargeError
from loraplex.sessions.quota import StoreQuota
from loraplex.sessions.response_redis_store import RedisResponseStore
from loraplex.sessions.responses import MemoryResponseStore, ResponseNotFoundError, StoredResponse
from waiting import wait_for_fresh_rate_window, wait_until

MODEL = "SmolLM2-135M-Instruct"
QUOTA = StoreQuota(what="stored responses", max_count=3, max_bytes=4000, max_record_bytes=2500,
                   max_count_setting="max_stored_responses_per_tenant")


def _record(response_id: str, *, tenant: str = "t1", text: str = "", expires_in: int = 60) -> StoredResponse:
    now = float(int(time.time()))  # whole seconds: records of one shape have one size
    return StoredResponse(id=response_id, tenant_id=tenant, model="m", body={"text": text}, input_items=[],
                          conversation=[], created_at=now, expires_at=now + expires_in)


def _size(record: StoredResponse) -> int:
    return len(record.to_json().encode())


@pytest.fixture(params=["redis", "memory"])
def store(request: pytest.FixtureRequest) -> Any:
    if request.param == "memory":
        return MemoryResponseStore()
    return RedisResponseStore(request.getfixturevalue("redis_client"), key_prefix=request.getfixturevalue("key_prefix"))


def test_count_bytes_and_record_caps_hold_per_tenant(store: Any) -> None:
    for i in range(3):
        store.put(_record(f"resp_{i}"), quota=QUOTA)
    assert store.usage("t1") == (3, 3 * _size(_record("resp_0")))
    with pytest.raises(StoredStateLimitError, match="max_stored_responses_per_tenant"):
        store.put(_record("resp_3"), quota=QUOTA)
    store.put(_record("resp_0", text="replaced"), quota=QUOTA)  # replacing a record is not one more
    store.put(_record("other", tenant="t2"), quota=QUOTA)  # another tenant's room is its own
    store.delete("t1", "resp_1")
    store.put(_record("resp_3"), quota=QUOTA)
    with pytest.raises(StoredStateTooLargeError, match="max_record_bytes"):
        store.put(_record("resp_big", text="x" * 3000), quota=QUOTA)
    assert store.usage("t1")[0] == 3 and store.usage("t2") == (1, _size(_record("other", tenant="t2")))


def test_bytes_cap_counts_what_is_stored(store: Any) -> None:
    quota = StoreQuota(max_bytes=3 * _size(_record("resp_a", text="y" * 500)), max_bytes_setting="bytes_setting")
    for name in ("resp_a", "resp_b", "resp_c"):
        store.put(_record(name, text="y" * 500), quota=quota)
    with pytest.raises(StoredStateLimitError, match="bytes_setting"):
        store.put(_record("resp_d", text="y" * 500), quota=quota)
    assert store.delete("t1", "resp_a").id == "resp_a"
    store.put(_record("resp_d", text="y" * 500), quota=quota)


def test_expired_records_leave_the_tenants_totals(store: Any) -> None:
    store.put(_record("resp_old", expires_in=1), quota=QUOTA)
    store.put(_record("resp_live"), quota=QUOTA)
    wait_until(lambda: store.usage("t1")[0] == 1, timeout_s=10, interval_s=0.1, what="the expired record to go")
    assert store.usage("t1") == (1, _size(_record("resp_live")))
    with pytest.raises(ResponseNotFoundError):
        store.get("t1", "resp_old")
    assert store.alive(["resp_old", "resp_live"]) == {"resp_live"}


@pytest.mark.timing  # a per-save time bound: run alone (make test)
def test_memory_store_saves_without_walking_its_records() -> None:
    clock = [1000.0]
    store = MemoryResponseStore(clock=lambda: clock[0])
    for i in range(20_000):
        record = _record(f"resp_{i}")
        record.expires_at = clock[0] + 10 + i  # expire one by one as the clock moves
        store.put(record)
    started = time.perf_counter()
    for i in range(200):
        store.put(_record(f"resp_new_{i}"))
    per_put = (time.perf_counter() - started) / 200
    assert per_put < 0.002, per_put  # a walk over 20,000 records takes several milliseconds
    clock[0] += 10 + 5_000  # 5,001 of the old ones expired
    assert store.usage("t1")[0] == 20_000 + 200 - 5_001


def test_turn_costs_match_the_rendered_prompt(smollm_path: Any) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    history = []
    for i in range(12):
        history += [{"role": "user", "content": f"question {i} " + "word " * i},
                    {"role": "assistant", "content": f"answer {i}"}]
    history.insert(5, {"role": "tool", "tool_call_id": "c1", "content": "a tool result"})
    costs = turn_costs(tokenizer, history)
    full = len(render_chat_prompt(tokenizer, history, {}))
    for k, start in enumerate(costs.starts):
        assert full - len(render_chat_prompt(tokenizer, history[start:], {})) == costs.cumulative[k]
    assert costs.num_messages_to_drop(num_dropped=0, excess=costs.cumulative[2]) == costs.starts[2]
    assert costs.num_messages_to_drop(num_dropped=0, excess=costs.cumulative[2] + 1) == costs.starts[3]
    assert costs.num_messages_to_drop(num_dropped=costs.starts[3], excess=1) == costs.starts[4]
    assert costs.num_messages_to_drop(num_dropped=0, excess=costs.num_tokens + 1) == len(history)
    assert costs.num_tokens_before(costs.starts[3]) == costs.cumulative[3]


# ---- through the API -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    with start_server(max_stored_responses_per_tenant=3, max_stored_response_bytes=64 * 1024,
                      max_item_id_chars=40, max_description_chars=100) as running:
        yield running


def _post(server: Any, body: dict[str, Any], label: str = "all", key: str | None = None) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/responses", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key or server.keys[label]}"})


def _new_key(server: Any, **limits: int) -> str:
    created = httpx.post(f"{server.base_url}/v1/admin/tenants/acme/keys", json={"scopes": ["inference"], **limits},
                         headers={"Authorization": f"Bearer {server.keys['admin']}"})
    assert created.status_code == 201, created.text
    return created.json()["key"]


def test_a_tenant_past_its_stored_responses_gets_a_429_naming_the_setting(server: Any) -> None:
    client = server.client("all")
    made = [client.responses.create(model=MODEL, input=f"hi {i}", max_output_tokens=1) for i in range(3)]
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            client.responses.create(model=MODEL, input="one more", max_output_tokens=1)
        assert refused.value.code == "stored_state_limit_exceeded"
        assert "max_stored_responses_per_tenant" in refused.value.message
        # Past the limit, an unstored response is still served (one sampled token, which may decode to "").
        unstored = client.responses.create(model=MODEL, input="unstored", max_output_tokens=1, store=False)
        assert unstored.usage.output_tokens == 1 and unstored.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        server.client("globex").responses.create(model=MODEL, input="mine", max_output_tokens=1)  # another tenant
        client.responses.delete(made.pop().id)
        made.append(client.responses.create(model=MODEL, input="room again", max_output_tokens=1))
    finally:
        for response in made:
            client.responses.delete(response.id)


def test_a_record_past_its_size_is_refused_before_generating(server: Any) -> None:
    answer = _post(server, {"model": MODEL, "input": [{"role": "user", "content": "x", "id": f"msg_{i}"}
                                                      for i in range(2000)], "max_output_tokens": 1})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "stored_state_too_large"
    assert "max_stored_response_bytes" in answer.json()["error"]["message"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"input": [{"role": "user", "content": "hi", "id": "m" * 41}]}, "input[0].id"),
    ({"input": [{"type": "function_call_output", "call_id": "c" * 41, "output": "x"}]}, "input[0].call_id"),
    ({"tools": [{"type": "function", "name": "f", "description": "d" * 101}]}, "tools[0].description"),
    ({"text": {"format": {"type": "json_object", "description": "d" * 101}}}, "text.format.description"),
    ({"tool_choice": {"type": "function", "name": "n" * 41}}, "tool_choice.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"input": [{"role": ["user"], "content": "hi"}]}, "input[0].role"),  # unhashable: was a 500
    ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "hi"}]}]}, "input[0].content[0].type"),
])
def test_the_callers_own_strings_are_bounded(server: Any, extra: dict[str, Any], param: str) -> None:
    answer = _post(server, {"model": MODEL, "input": "hi", "max_output_tokens": 1, **extra})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_tools_and_tool_choice_are_kept_without_extra_keys(server: Any) -> None:
    tool = {"type": "function", "name": "lookup", "description": "finds", "parameters": {"type": "object"},
            "x_padding": "p" * 10_000, "strict": False}
    answer = _post(server, {"model": MODEL, "input": "hi", "max_output_tokens": 1, "tools": [tool],
                            "tool_choice": {"type": "function", "name": "lookup", "x_padding": "p" * 10_000}})
    assert answer.status_code == 200, answer.text
    stored = server.services.extensions.domain_state["responses"].store.get(server.tenants["acme"],
                                                                            answer.json()["id"])
    assert stored.body["tools"] == [{"type": "function", "name": "lookup", "description": "finds",
                                     "parameters": {"type": "object"}, "strict": False}]
    assert stored.body["tool_choice"] == {"type": "function", "name": "lookup"}
    assert "p" * 100 not in stored.to_json()
    server.client("all").responses.delete(answer.json()["id"])


def test_fifty_thousand_input_items_are_refused_unparsed(server: Any) -> None:
    body = json.dumps({"model": MODEL, "input": [{"role": "user", "content": "x"}] * 50_000}).encode()
    started = time.perf_counter()
    answer = httpx.post(server.base_url + "/v1/responses", content=body, timeout=60,
                        headers={"Authorization": f"Bearer {server.keys['all']}", "Content-Type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input", answer.text
    assert "50000" in answer.json()["error"]["message"]
    assert time.perf_counter() - started < 2


def test_pins_of_responses_go_with_them(server: Any) -> None:
    chains = server.services.extensions.domain_state["responses"]
    client = server.client("all")
    kept = client.responses.create(model=MODEL, input="remember me", max_output_tokens=2)
    assert chains.num_pinned_here >= 1 and kept.id in chains._pins
    gone = chains.sweep(now=time.time() + server.settings.response_retention_s + 1)  # as if it had expired
    assert kept.id in gone and kept.id not in chains._pins
    client.responses.delete(kept.id)
    # A response that could not be stored lets its KV go at once: the tenant's store is full here.
    made = [client.responses.create(model=MODEL, input=f"fill {i}", max_output_tokens=1) for i in range(3)]
    try:
        before = set(chains._pins)
        with pytest.raises(openai.RateLimitError):
            client.responses.create(model=MODEL, input="no room", max_output_tokens=1)
        assert set(chains._pins) == before
    finally:
        for response in made:
            client.responses.delete(response.id)


def test_truncation_tokenizes_a_long_chain_once_and_counts_it(server: Any) -> None:
    chains = server.services.extensions.domain_state["responses"]
    conversation = []
    for i in range(300):
        conversation += [{"role": "user", "content": f"turn {i}: " + "tell me about rivers " * 4},
                         {"role": "assistant", "content": f"answer {i}: " + "rivers flow to the sea " * 4}]
    parent = StoredResponse(id="resp_longchain", tenant_id=server.tenants["acme"], model=MODEL, body={},
                            input_items=[], conversation=conversation)
    parent.expires_at = time.time() + 600
    chains.store.put(parent)
    key = _new_key(server, tpm_limit=20_000)  # above one request's prompt and what it leaves out, not two
    body = {"model": MODEL, "input": "and the sea?", "previous_response_id": parent.id, "truncation": "auto",
            "max_output_tokens": 2, "store": False}
    wait_for_fresh_rate_window(margin_s=30)  # both requests in one rate-limit window
    started = time.process_time()  # CPU time, whatever else loads the machine
    answer = _post(server, body, key=key)
    cpu_s = time.process_time() - started
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["input_tokens"] < server.services.engine.max_model_len
    assert cpu_s < 60, cpu_s  # re-rendering the history once per dropped turn took ~250 s of CPU
    # The ~16,000 tokens read and left out counted against the key's tokens per minute.
    again = _post(server, body, key=key)
    assert again.status_code == 429 and again.json()["error"]["code"] == "tokens_rate_limit_exceeded", again.text


def test_truncation_also_keeps_the_message_count_within_its_limit() -> None:
    from loraplex.platform.responses.schemas import ResponseCreate
    from loraplex.platform.responses.turn import ResponseTurn

    conversation = [{"role": role, "content": f"{role} {i}"} for i in range(1500) for role in ("user", "assistant")]
    parent = StoredResponse(id="resp_p", tenant_id="t", model=MODEL, body={}, input_items=[],
                            conversation=conversation)
    body = ResponseCreate.model_validate({"model": MODEL, "input": "next", "previous_response_id": "resp_p",
                                          "truncation": "auto", "instructions": "be brief"})
    turn = ResponseTurn.build("resp_c", body, parent, created_at=0)
    turn.fit_messages(2048)
    messages = turn.messages()
    assert len(messages) <= 2048 and len(messages) >= 2046
    assert messages[0]["role"] == "system" and messages[1]["role"] == "user" and messages[-1]["content"] == "next"
