"""Stored responses live in Redis when it is configured, so any API server can continue a chain."""

from __future__ import annotations

import time

import openai
import pytest
from loraplex.sessions.response_redis_store import RedisResponseStore
from loraplex.sessions.responses import MemoryResponseStore, ResponseNotFoundError, StoredResponse

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def redis_server(start_server, redis_url, redis_prefix):
    with start_server(redis_url=redis_url, redis_key_prefix=f"{redis_prefix}resp:") as running:
        yield running


def test_chain_state_is_in_redis(redis_server, redis_client):
    prefix = redis_server.settings.redis_key_prefix
    client = redis_server.client("all")
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0)
    key = f"{prefix}response:{first.id}"
    assert 0 < redis_client.ttl(key) <= redis_server.settings.response_retention_s

    # Another process's store (a new connection) reads it, scoped by tenant.
    store = RedisResponseStore(redis_client, key_prefix=prefix)
    record = store.get(redis_server.tenants["acme"], first.id)
    assert record.body["output"][-1]["content"][0]["text"] == first.output_text
    assert record.conversation == [{"role": "user", "content": "My name is Ada."},
                                   {"role": "assistant", "content": first.output_text}]
    with pytest.raises(ResponseNotFoundError):
        store.get(redis_server.tenants["globex"], first.id)

    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    reference = redis_server.client("globex").chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[*record.conversation, {"role": "user", "content": "What is my name?"}])
    assert second.output_text == reference.choices[0].message.content

    redis_client.delete(key)  # the server keeps no copy of its own: gone from Redis, gone
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(second.id).previous_response_id == first.id  # a child stands on its own


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_store_is_tenant_scoped_and_expires(kind, redis_client, key_prefix):
    store = RedisResponseStore(redis_client, key_prefix=key_prefix) if kind == "redis" else MemoryResponseStore()
    now = time.time()
    live = StoredResponse(id="resp_live", tenant_id="t1", model="m", body={"id": "resp_live"}, input_items=[],
                          conversation=[], created_at=now, expires_at=now + 60)
    expired = StoredResponse(id="resp_old", tenant_id="t1", model="m", body={}, input_items=[], conversation=[],
                             created_at=now - 120, expires_at=now - 60)
    store.put(live)
    store.put(expired)
    assert store.get("t1", "resp_live").body == {"id": "resp_live"}
    for tenant, response_id in (("t2", "resp_live"), ("t1", "resp_old"), ("t1", "resp_unknown")):
        with pytest.raises(ResponseNotFoundError):
            store.get(tenant, response_id)
    with pytest.raises(ResponseNotFoundError):
        store.delete("t2", "resp_live")
    assert store.delete("t1", "resp_live").id == "resp_live"
    with pytest.raises(ResponseNotFoundError):
        store.get("t1", "resp_live")
