"""`loraplex serve` as it runs in production: a supervisor, one engine-core process, two API server processes.

One server for the module (starting it loads the model once); the engine-core kill runs last, then the
server is started again on the same data and must serve.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from loraplex.billing.models import UsageEventRow
from loraplex.platform.auth import store
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.db import migrate
from loraplex.platform.db.session import make_db_engine, make_session_factory
from server_process import ServerProcess, server_env
from sqlalchemy import select
from waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 400, "extra_body": {"ignore_eos": True}, "stream": True}


@pytest.fixture(scope="module")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('core-db') / 'loraplex.db'}"


@pytest.fixture(scope="module")
def api_key(database_url: str) -> str:
    migrate.upgrade(database_url)
    engine = make_db_engine(database_url)
    with make_session_factory(engine)() as db:
        tenant = store.create_tenant(db, name="multiprocess")
        key = store.create_api_key(db, tenant=tenant, scopes=[Scope.INFERENCE, Scope.USAGE], name="mp").key
    engine.dispose()
    return key


@pytest.fixture(scope="module")
def server(database_url: str, api_key: str, smollm_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("core-server")
    env = server_env(database_url=database_url, data_dir=data_dir, model_path=smollm_path,
                     kv_cache_memory_mb=128, api_servers=2, max_num_seqs=16, drain_timeout_s=60)
    with ServerProcess(env, data_dir, name="mp-server") as running:
        running.start(timeout_s=300)
        yield running


def _client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _health_fresh_connection(server: ServerProcess) -> dict[str, Any]:
    with httpx.Client() as client:  # a new connection: the kernel hands it to either API server
        return client.get(server.url + "/healthz", timeout=10).json()


def _engine_gauge(server: ServerProcess, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_two_api_servers_share_one_engine_core(server: ServerProcess) -> None:
    api_pids, core_pids = set(), set()
    num_calls = 0
    for _ in range(200):
        health = _health_fresh_connection(server)
        num_calls += 1
        api_pids.add(health["api_server_pid"])
        core_pids.add(health["engine"]["pid"])
        if len(api_pids) == 2:
            break
    assert len(api_pids) == 2, "every connection went to the same API server process"
    assert len(core_pids) == 1 and server.pid not in api_pids | core_pids
    # Either process's /metrics counts the requests both served (Prometheus multiprocess mode).
    for _ in range(4):
        assert _engine_gauge(server, 'loraplex_http_requests_total{route="/healthz",status="200"}') >= num_calls


def test_every_serving_process_froze_its_startup_heap(server: ServerProcess) -> None:
    """The engine core and each API server move their start-up objects out of the collector's full passes."""
    frozen: dict[str, list[int]] = {}
    for line in server.log_tail(1_000_000).splitlines():
        match = re.search(r"(engine core|API server): (\d+) start-up objects frozen", line)
        if match:
            frozen.setdefault(match[1], []).append(int(match[2]))
    assert len(frozen.get("engine core", [])) == 1, frozen
    assert len(frozen.get("API server", [])) >= 2, frozen  # two API servers (and the batch worker)
    # torch, transformers and the app: hundreds of thousands of objects each full pass no longer scans
    assert min(count for counts in frozen.values() for count in counts) > 100_000, frozen


def test_concurrent_requests_through_both_servers_are_correct_and_interleaved(server: ServerProcess,
                                                                              api_key: str) -> None:
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24,
           "temperature": 0}
    reference = _client(server, api_key).chat.completions.create(**ask).choices[0].message.content
    results: dict[int, dict[str, Any]] = {}

    def stream(index: int) -> None:
        started = time.monotonic()
        first = None
        text = []
        with _client(server, api_key) as client:  # its own connection pool: spread over both servers
            for chunk in client.chat.completions.create(**ask, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.monotonic()
                    text.append(chunk.choices[0].delta.content)
        results[index] = {"text": "".join(text), "first": first - started, "done": time.monotonic() - started,
                          "started": started, "first_at": first, "done_at": time.monotonic()}

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 8
    assert all(r["text"] == reference for r in results.values()), {i: r["text"] for i, r in results.items()}
    # Continuous batching across both servers: every stream had its first token before any stream was done.
    assert max(r["first_at"] for r in results.values()) < min(r["done_at"] for r in results.values())


def test_abort_through_either_server_frees_kv_blocks(server: ServerProcess, api_key: str) -> None:
    total = _engine_gauge(server, "loraplex_kv_blocks_free") + _engine_gauge(server, "loraplex_kv_blocks_used")
    clients = [_client(server, api_key) for _ in range(6)]  # six connections: both servers get some
    streams = [client.chat.completions.create(**LONG) for client in clients]
    for stream in streams:
        next(iter(stream))
    wait_until(lambda: _engine_gauge(server, "loraplex_engine_running_requests") == 6, timeout_s=30, interval_s=0.1,
               what="six running requests")
    for stream, client in zip(streams, clients, strict=True):
        stream.close()
        client.close()
    wait_until(lambda: _engine_gauge(server, "loraplex_engine_running_requests") == 0, timeout_s=15, interval_s=0.1,
               what="the aborts to be applied")
    wait_until(lambda: _engine_gauge(server, "loraplex_kv_blocks_free") == total, timeout_s=5, interval_s=0.1,
               what="every KV block to be free")


def test_sigkill_of_the_engine_core_fails_open_requests_and_the_server_exits(
        server: ServerProcess, api_key: str, database_url: str) -> None:
    completed = []
    for _ in range(3):
        raw = _client(server, api_key).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        completed.append(raw.headers["x-request-id"])
    outcomes: dict[int, str] = {}
    ended_at: dict[int, float] = {}
    receiving = threading.Barrier(5)

    def stream(index: int) -> None:
        try:
            with _client(server, api_key) as client:
                chunks = client.chat.completions.create(**LONG)
                next(iter(chunks))
                receiving.wait(30)
                for _ in chunks:
                    pass
            outcomes[index] = "finished"
        except openai.APIError as exc:
            outcomes[index] = f"error: {exc}"
        finally:
            ended_at[index] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    receiving.wait(60)
    core_pid = server.engine_core_pid()
    os.kill(core_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a stream hangs after the engine core died"
    assert all("engine core process" in outcome for outcome in outcomes.values()), outcomes
    assert max(ended_at.values()) - killed_at < 5
    unhealthy = httpx.get(server.url + "/healthz", timeout=5)
    assert unhealthy.status_code == 503 and unhealthy.json()["engine"]["alive"] is False
    refused = _client(server, api_key).chat.completions.with_raw_response
    with pytest.raises(openai.APIStatusError) as info:
        refused.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert info.value.status_code == 503 and info.value.body["code"] == "engine_unavailable"

    assert server.process is not None
    assert server.process.wait(timeout=60) != 0  # the supervisor exits non-zero: restart me
    server.process = None
    rows = _ledger(database_url)
    assert set(completed) <= set(rows) and all(rows[r].status in ("completed", "length") for r in completed)
    failed = [r for r in rows.values() if r.status == "failed"]
    # The four cut-off streams, billed for what they produced; the request refused after the kill, for nothing.
    assert len([r for r in failed if r.output_tokens >= 1]) == 4
    assert all(r.input_tokens == r.output_tokens == 0 for r in failed if r.output_tokens == 0)

    server.start(timeout_s=300)
    answer = _client(server, api_key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert answer.choices[0].message.content
    wait_until(lambda: len(_ledger(database_url)) == len(rows) + 1, timeout_s=30, interval_s=0.1,
               what="one more ledger row")
    again = _ledger(database_url)
    assert {r: again[r].status for r in completed} == {r: rows[r].status for r in completed}  # still once each


def _ledger(database_url: str) -> dict[str, UsageEventRow]:
    engine = make_db_engine(database_url)
    try:
        with make_session_factory(engine)() as db:
            return {row.request_id: row for row in db.scalars(select(UsageEventRow))}
    finally:
        engine.dispose()


@pytest.mark.parametrize("whom", ["the supervisor", "the process group"])
def test_sigterm_drains_in_flight_streams_then_exits_cleanly(server: ServerProcess, api_key: str, whom: str) -> None:
    """Runs after the restart above: SIGTERM lets an open stream finish whole, and the server exits 0, whether it
    reaches the supervisor alone (an orchestrator) or every process of the server at once (systemd's default
    KillMode, `kill -TERM -<pgid>`): the engine core and tensor-parallel workers outlive the API servers' drain."""
    if server.process is None:  # stopped by the case before
        server.start(timeout_s=300)
    received: dict[str, Any] = {"text": [], "finish": None}

    def stream() -> None:
        with _client(server, api_key) as client:
            for chunk in client.chat.completions.create(**{**LONG, "max_tokens": 32}):
                if chunk.choices:
                    received["text"].append(chunk.choices[0].delta.content or "")
                    received["finish"] = chunk.choices[0].finish_reason or received["finish"]

    thread = threading.Thread(target=stream)
    thread.start()
    wait_until(lambda: len(received["text"]) >= 2, timeout_s=60, interval_s=0.1, what="two streamed chunks")
    assert server.process is not None
    if whom == "the supervisor":
        server.process.send_signal(signal.SIGTERM)
    else:
        os.killpg(server.process.pid, signal.SIGTERM)  # its own session: the server's processes only
    thread.join(120)
    assert not thread.is_alive() and received["finish"] == "length"  # the whole answer, not cut off
    assert server.process.wait(timeout=60) == 0
    server.process = None
