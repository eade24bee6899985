"""/healthz, /metrics and the request id on every response and log line."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from e2e_helpers import MODEL, auth, chat_body, post
from loraplex.platform.request_context import RequestIdLogFilter


def test_healthz(api_server) -> None:  # type: ignore[no-untyped-def]
    r = httpx.get(api_server.base_url + "/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == MODEL
    assert r.headers["x-request-id"].startswith("req_")


def test_metrics_after_traffic(api_server, openai_client) -> None:  # type: ignore[no-untyped-def]
    list(openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    ))
    post(api_server, "/v1/chat/completions", chat_body(model="nope"), api_server.keys["inference"])
    text = httpx.get(api_server.base_url + "/metrics").text

    def value(pattern: str) -> float:
        match = re.search(pattern + r" ([0-9.e+-]+)", text)
        assert match, pattern
        return float(match.group(1))

    assert value(r'loraplex_http_requests_total\{route="/v1/chat/completions",status="200"\}') >= 1
    assert value(r'loraplex_http_requests_total\{route="/v1/chat/completions",status="404"\}') >= 1
    assert value("loraplex_time_to_first_token_seconds_count") >= 1
    assert value("loraplex_inter_token_latency_seconds_count") >= 1
    assert value("loraplex_prompt_tokens_total") > 0 and value("loraplex_completion_tokens_total") > 0
    for gauge in ("loraplex_engine_queue_depth", "loraplex_engine_running_requests", "loraplex_kv_blocks_used",
                  "loraplex_kv_blocks_free", "loraplex_prefix_cache_hit_rate"):
        assert re.search(rf"^{gauge} ", text, re.M), gauge


def test_request_id_on_log_lines(api_server, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    caplog.handler.addFilter(RequestIdLogFilter())
    with caplog.at_level(logging.INFO, logger="loraplex"):
        r = post(api_server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                 api_server.keys["inference"])
    request_id = r.headers["x-request-id"]
    lines = [rec for rec in caplog.records if rec.name.startswith("loraplex.platform")]
    assert lines and all(rec.request_id == request_id for rec in lines)
    assert any("prompt_tokens=" in rec.getMessage() for rec in lines)
    assert r.json()["id"] == "cmpl-" + request_id.removeprefix("req_")


def test_request_id_on_errors(api_server) -> None:  # type: ignore[no-untyped-def]
    r = httpx.get(api_server.base_url + "/v1/models", headers=auth("lpx_wrong"))
    assert r.status_code == 401 and r.headers["x-request-id"].startswith("req_")
    r = httpx.get(api_server.base_url + "/nowhere")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert r.headers["x-request-id"].startswith("req_")
