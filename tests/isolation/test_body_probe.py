"""Large generation bodies whose counted lists are past their limits are refused before they are parsed."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from loraplex.platform.api.body_probe import PROBE_MIN_BYTES, probe_counts
from loraplex.platform.api.request_limits import RequestLimits

pytestmark = pytest.mark.timing  # wall-clock bounds: run alone (make test)

LIMITS = RequestLimits()
CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}


def tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(n)]


@pytest.mark.parametrize(("body", "param", "count"), [
    ({**CHAT, "tools": tools(20_000)}, "tools", "20000"),
    ({**CHAT, "logit_bias": {str(i): 1 for i in range(49152)}}, "logit_bias", "49152"),
    ({**CHAT, "stop": ["x" * 10] * 5000}, "stop", "5000"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi"}] * 3000}, "messages", "3000"),
    ({"model": "m", "prompt": ["Say hi."] * 3000}, "prompt", "3000"),
])
def test_each_counted_list_past_its_limit_is_named(body, param, count):
    refusal = probe_counts(json.dumps(body).encode(), LIMITS, max_tools=128)
    assert refusal is not None and refusal.param == param and count in refusal.message


@pytest.mark.parametrize("body", [
    {**CHAT, "tools": tools(128), "logit_bias": {str(i): 1 for i in range(300)}, "stop": ["a", "b", "c", "d"]},
    {"model": "m", "prompt": list(range(5000))},  # one prompt of token ids, however long
    {"model": "m", "prompt": "x" * 100_000, "stop": "a single stop string"},
    {**CHAT, "tools": "not a list", "logit_bias": [1, 2]},  # wrong shapes: the normal parser reports them
])
def test_bodies_within_limits_or_of_another_shape_pass(body):
    assert probe_counts(json.dumps(body).encode(), LIMITS, max_tools=128) is None


def test_malformed_json_is_left_to_the_parser():
    assert probe_counts(b'{"tools": [' + b"1," * 50_000, LIMITS, max_tools=128) is None


def test_a_body_nested_too_deep_to_scan_is_refused_as_the_parser_would():
    """msgspec, like Python's parser, raises RecursionError past ~1,000 levels: that is a 400, not a 500."""
    raw = b'{"model": "m", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert len(raw) >= PROBE_MIN_BYTES
    refusal = probe_counts(raw, LIMITS, max_tools=128)
    assert refusal is not None and refusal.param is None and "nest deeper than the parser allows" in refusal.message


def test_probing_is_fast_where_parsing_is_not():
    raw = json.dumps({**CHAT, "tools": tools(20_000)}).encode()
    start = time.perf_counter()
    for _ in range(5):
        assert probe_counts(raw, LIMITS, max_tools=128) is not None
    probed = (time.perf_counter() - start) / 5
    start = time.perf_counter()
    for _ in range(5):
        json.loads(raw)
    parsed = (time.perf_counter() - start) / 5
    assert probed < parsed / 4, (probed, parsed)


def test_through_the_server_refused_unparsed_and_large_good_bodies_still_served(start_server):
    with start_server() as server, httpx.Client(base_url=server.base_url, timeout=60,
                                               headers={"Authorization": f"Bearer {server.keys['all']}"}) as client:
        reply = client.post("/v1/chat/completions", json={**CHAT, "tools": tools(20_000)})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "tools" and "20000" in error["message"]
        assert error["type"] == "invalid_request_error"
        long_prompt = {"model": CHAT["model"], "prompt": "Hello " * (PROBE_MIN_BYTES // 5), "max_tokens": 1}
        reply = client.post("/v1/completions", json=long_prompt)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"  # parsed
        reply = client.post("/v1/chat/completions", json={**CHAT, "tools": tools(3),
                                                          "messages": [{"role": "user", "content": "x " * 40_000}]})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"  # too long a prompt
        padded = json.dumps({**CHAT, "tools": tools(3)}).encode()[:-1] + b" " * PROBE_MIN_BYTES + b"}"
        reply = client.post("/v1/chat/completions", content=padded, headers={"Content-Type": "application/json"})
        assert reply.status_code == 200, reply.text  # probed, replayed whole, served
