"""A client that goes away frees the engine's KV blocks at once (checked through the engine's counters)."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from e2e_helpers import MODEL, auth
from loraplex.platform.extensions import RequestRecord, RequestStatus
from waiting import wait_until

LONG = {"model": MODEL, "prompt": "Write a very long story about a cat.", "max_tokens": 1500, "ignore_eos": True}


class RecordingMeter:
    """A UsageRecorder (the billing extension point) that keeps what it is given."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    async def record(self, record: RequestRecord) -> None:
        self.records.append(record)


@pytest.fixture
def meter(api_server) -> Any:  # type: ignore[no-untyped-def]
    recorder = RecordingMeter()
    recorders = api_server.services.extensions.usage_recorders
    recorders.append(recorder)
    yield recorder
    recorders.remove(recorder)


def wait_idle(engine: Any, timeout_s: float = 30) -> dict:
    def idle_stats() -> dict | None:
        stats = engine.stats()
        return stats if stats["num_running"] == 0 and stats["num_waiting"] == 0 else None

    return wait_until(idle_stats, timeout_s=timeout_s, interval_s=0.01, what=lambda: f"an idle engine: {engine.stats()}")


def wait_for_release(engine: Any, baseline_used: int, timeout_s: float = 2.0) -> None:
    """Within `timeout_s` the engine is idle with no more blocks in use than before the request."""
    def released() -> bool:
        stats = engine.stats()
        return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_blocks_used"] <= baseline_used

    wait_until(released, timeout_s=timeout_s, interval_s=0.005,
               what=lambda: f"the blocks to be released: {engine.stats()}")


def test_stream_disconnect_frees_blocks(api_server, meter) -> None:  # type: ignore[no-untyped-def]
    engine = api_server.services.engine
    baseline = wait_idle(engine)
    body = {**LONG, "stream": True}
    with httpx.stream("POST", api_server.base_url + "/v1/completions", json=body,
                      headers=auth(api_server.keys["inference"]), timeout=60) as stream:
        lines = stream.iter_lines()
        received = 0
        while received < 5:
            if next(lines).startswith("data: "):
                received += 1
        during = engine.stats()
        assert during["num_blocks_used"] > baseline["num_blocks_used"]
    wait_for_release(engine, baseline["num_blocks_used"], timeout_s=2.0)
    generated = engine.stats()["generation_tokens_total"] - baseline["generation_tokens_total"]
    assert generated < 300, "the request kept generating after the client left"
    wait_until(lambda: meter.records, timeout_s=2, what="the usage record")
    assert [r.status for r in meter.records] == [RequestStatus.ABORTED]
    assert meter.records[0].num_output_tokens >= 5


@pytest.mark.parametrize("prompts", [1, 2], ids=["one prompt", "two prompts"])
def test_non_streaming_disconnect_frees_blocks_and_bills_what_was_generated(api_server, meter, prompts) -> None:  # type: ignore[no-untyped-def]
    engine = api_server.services.engine
    baseline = wait_idle(engine)
    # A raw socket, closed once the engine has generated for it: a fixed client timeout could expire before a
    # busy machine finishes the prefill, and then nothing would have been generated to abandon.
    url = httpx.URL(api_server.base_url)
    body = json.dumps({**LONG, "prompt": LONG["prompt"] if prompts == 1 else [LONG["prompt"], "Tell me a tale."]}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {api_server.keys['inference']}\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection((url.host, url.port), timeout=60) as connection:
        connection.sendall(head.encode() + body)
        wait_until(lambda: engine.stats()["generation_tokens_total"] > baseline["generation_tokens_total"],
                   timeout_s=60, interval_s=0.01, what=lambda: f"the request to start generating: {engine.stats()}")
    wait_for_release(engine, baseline["num_blocks_used"])
    generated = engine.stats()["generation_tokens_total"] - baseline["generation_tokens_total"]
    assert 0 < generated < 1500 * prompts, "the request kept generating after the client left"
    wait_until(lambda: meter.records, timeout_s=2, what="the usage record")
    assert [r.status for r in meter.records] == [RequestStatus.ABORTED]
    # Every token the engine generated before the abort is billed, though the client never read one.
    assert meter.records[0].num_output_tokens == generated


def test_meter_gets_exactly_one_record_per_request(api_server, meter, openai_client) -> None:  # type: ignore[no-untyped-def]
    reply = openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks
    wait_until(lambda: len(meter.records) >= 2, timeout_s=2, what=lambda: f"two usage records: {meter.records}")
    assert len(meter.records) == 2
    first, second = meter.records
    assert first.kind == "completion" and first.num_output_tokens == reply.usage.completion_tokens
    assert first.num_prompt_tokens == reply.usage.prompt_tokens
    assert first.status in (RequestStatus.LENGTH, RequestStatus.COMPLETED)
    assert first.tenant_id == api_server.tenants["acme"] and first.key_id == api_server.key_ids["all"]
    assert second.kind == "chat" and second.time_to_first_token_s is not None
