"""The model-server protocol of one `loraplex serve`, as a gateway sees it.

/metrics parses with prometheus_client's text parser and has every vLLM name
and label the Inference Extension, llm-d and vLLM's dashboards read; an
adapter request that runs shows in `running_lora_adapters` and one that waits
(one sequence at a time) in `waiting_lora_adapters`, by the names requests
use; /metrics needs its token when one is set; and the engine core publishes
KV-cache events with the adapter's name to a real ZeroMQ subscriber.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from loraplex.platform.db import migrate
from prometheus_client.parser import text_string_to_metric_families
from replica_helpers import (
    MODEL,
    EventSubscriber,
    bearer,
    create_tenant,
    upload_adapter,
    wait_until,
    write_adapter,
)
from server_process import ServerProcess, server_env

TOKEN = "scrape-me"
POD = "10.1.2.3"

GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc"]
COUNTERS = ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds"]


@pytest.fixture(scope="module")
def server(smollm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir = tmp_path_factory.mktemp("metrics-contract")
    database_url = f"sqlite:///{data_dir / 'loraplex.db'}"
    migrate.upgrade(database_url)
    _, key, _ = create_tenant(database_url, "acme")
    subscriber = EventSubscriber()
    # One sequence at a time: a second adapter request waits while the first runs. No batch work is sent, so no
    # idle batch-worker process (~8 CPU-seconds of a 2-core box).
    env = server_env(database_url=database_url, data_dir=data_dir, model_path=smollm_path, max_num_seqs=1,
                     kv_cache_memory_mb=96, max_loras=2, metrics_bearer_token=TOKEN,
                     kv_events_endpoint=subscriber.endpoint, kv_events_pod=POD, api_servers=2,
                     batch_workers_enabled=False)
    process = ServerProcess(env, data_dir, name="metrics-server")
    try:
        with process:
            process.start(timeout_s=600)  # a loaded 2-core box takes minutes to import and load
            adapters = {name: upload_adapter(process.url, key, name, write_adapter(data_dir / name, smollm_path, seed))
                        for seed, name in enumerate(("pirate", "parrot"))}
            assert all(a["status"] == "ready" for a in adapters.values()), adapters
            yield {"url": process.url, "key": key, "subscriber": subscriber}
    finally:
        subscriber.close()


def scrape(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/metrics", headers=bearer(TOKEN), timeout=30)
    assert response.status_code == 200, response.text
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def chat(server: dict[str, Any], model: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    return httpx.post(server["url"] + "/v1/chat/completions", headers=bearer(server["key"]), timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
        "max_tokens": max_tokens, "temperature": 0, **extra})


def lora_info(families: dict[str, Any]) -> dict[str, str]:
    (sample,) = families["vllm:lora_requests_info"].samples
    assert abs(sample.value - time.time()) < 60  # the value is a timestamp: the newest series wins
    return sample.labels


def test_every_name_and_label_is_there_after_requests_with_and_without_adapters(server: dict[str, Any]) -> None:
    assert chat(server, MODEL).status_code == 200
    # A stream's tokens arrive apart: inter-token gaps. The API server merges outputs that queued up while it was
    # busy, and on a loaded 2-core box all 8 tokens of a short stream once came as one output (no gap): 64 tokens
    # leave many steps for the gaps to show.
    assert chat(server, "pirate", max_tokens=64, stream=True).status_code == 200
    families = scrape(server["url"])
    for name in GAUGES + COUNTERS + HISTOGRAMS:
        assert name in families, name
        assert all(s.labels.get("model_name") == MODEL for s in families[name].samples), name
    assert families["vllm:prompt_tokens"].samples[0].name == "vllm:prompt_tokens_total"
    assert families["vllm:generation_tokens"].samples[0].value >= 16
    counts = {name: next(s.value for s in families[name].samples if s.name == name + "_count") for name in HISTOGRAMS}
    # both requests observed, summed over the two API servers (a whole answer's tokens arrive together: no gaps)
    assert counts["vllm:time_to_first_token_seconds"] >= 2 and counts["vllm:e2e_request_latency_seconds"] >= 2
    assert counts["vllm:inter_token_latency_seconds"] >= 1, counts
    (config,) = families["vllm:cache_config_info"].samples
    assert config.labels["block_size"] == "16" and int(config.labels["num_gpu_blocks"]) > 0 and config.value == 1
    usage = families["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0 <= usage <= 1
    info = lora_info(families)
    assert info["max_lora"] == "2" and info["running_lora_adapters"] == "" and info["waiting_lora_adapters"] == ""
    # ours stay beside vLLM's
    assert {"loraplex_engine_queue_depth", "loraplex_kv_blocks_used", "loraplex_session_turns_moved"} <= families.keys()


def test_a_running_adapter_and_a_queued_one_are_named(server: dict[str, Any]) -> None:
    stop_reading = threading.Event()
    results: dict[str, Any] = {}

    def stream_long() -> None:  # runs until the test has seen what it needs, then hangs up (the engine aborts it)
        body = {"model": "pirate", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 1000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server["url"] + "/v1/chat/completions", json=body, headers=bearer(server["key"]),
                          timeout=600) as response:
            results["pirate"] = response.status_code
            for _ in response.iter_lines():
                if stop_reading.is_set():
                    return

    def send_short() -> None:
        results["parrot"] = chat(server, "parrot", max_tokens=2).status_code

    long_one = threading.Thread(target=stream_long)
    queued = threading.Thread(target=send_short)
    long_one.start()
    try:
        wait_until(lambda: results.get("pirate", 200) != 200
                   or lora_info(scrape(server["url"]))["running_lora_adapters"] == "pirate",
                   what="pirate running", timeout_s=300)
        assert results.get("pirate", 200) == 200, results
        queued.start()
        families = wait_until(lambda: (f := scrape(server["url"])) and lora_info(f)["waiting_lora_adapters"]
                              == "parrot" and f, what="parrot waiting behind pirate", timeout_s=120)
        assert lora_info(families)["running_lora_adapters"] == "pirate"
        assert families["vllm:num_requests_running"].samples[0].value == 1
        assert families["vllm:num_requests_waiting"].samples[0].value >= 1
    finally:
        stop_reading.set()  # pirate's client hangs up: the engine aborts it and parrot runs
        long_one.join(600)
    queued.join(600)
    assert results == {"pirate": 200, "parrot": 200}
    after = wait_until(lambda: (f := scrape(server["url"])) and lora_info(f)["running_lora_adapters"] == "" and f,
                       what="nothing running")
    assert lora_info(after)["waiting_lora_adapters"] == ""


def test_metrics_need_the_token_when_one_is_set(server: dict[str, Any]) -> None:
    for headers in ({}, bearer("wrong"), {"Authorization": "Basic " + TOKEN}):
        refused = httpx.get(server["url"] + "/metrics", headers=headers, timeout=30)
        assert refused.status_code == 401
        error = refused.json()["error"]
        assert error["code"] == "invalid_metrics_token" and error["type"]
    assert "vllm:num_requests_running" in httpx.get(server["url"] + "/metrics", headers=bearer(TOKEN)).text


def test_the_engine_core_publishes_kv_events_with_the_adapters_name(server: dict[str, Any]) -> None:
    subscriber: EventSubscriber = server["subscriber"]
    topic = f"kv@{POD}@{MODEL}"
    wait_until(lambda: any(t == topic for t, _, _ in subscriber.drain()), what="the engine core's first batch")
    assert chat(server, "pirate", max_tokens=4).status_code == 200
    stored = wait_until(lambda: [e for e in subscriber.events(topic) if e[0] == "BlockStored" and e[7] == "pirate"],
                        what=lambda: f"a BlockStored of pirate; received: {subscriber.drain()[-6:]}")
    _, hashes, _, token_ids, block_size, lora_id, medium, _ = stored[-1]
    assert block_size == 16 and len(token_ids) == 16 * len(hashes) and medium == "GPU" and lora_id > 0
    assert all(isinstance(h, int) for h in hashes)
    numbers = [n for t, n, _ in subscriber.drain() if t == topic]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    base = [e for e in subscriber.events(topic) if e[0] == "BlockStored" and e[7] is None]
    assert base  # the base model's requests of the earlier tests
