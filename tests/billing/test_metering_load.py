"""Metering under load through the real server (ledger on PostgreSQL), with the openai client.

A mix of plain, streamed, n=2, stop-string, session and tool-call requests runs
concurrently; a tenth of the streams are dropped by the client mid-way. Then:
one ledger event per request, each completed request's event equals the usage
the server returned, and the ledger's totals equal the engine's own counters.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from loraplex.billing.models import UsageEventRow
from sqlalchemy import select

MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS = 120
TOPICS = ["cats", "rain", "the moon", "bread", "rivers", "music", "snow", "trains", "apples", "clocks"]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@dataclass
class Sent:
    kind: str
    request_id: str
    usage: dict | None = None  # None: the client went away before the end


def _one(client, kind: str, rng: random.Random, session_id: str | None) -> Sent:
    messages = [{"role": "user", "content": f"Write about {rng.choice(TOPICS)} in one line."}]
    common = {"model": MODEL, "messages": messages, "temperature": 0}
    chat = client.chat.completions.with_raw_response
    if kind in ("stream", "disconnect"):
        raw = chat.create(**common, max_tokens=rng.randint(8, 24), stream=True,
                          stream_options={"include_usage": True}, extra_body={"ignore_eos": kind == "disconnect"})
        stream = raw.parse()
        usage = None
        for index, chunk in enumerate(stream):
            if kind == "disconnect" and index == 2:
                stream.close()  # the client goes away mid-way
                break
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
        return Sent(kind, raw.headers["x-request-id"], usage)
    extra: dict = {}
    if kind == "n2":
        extra = {"n": 2, "max_tokens": rng.randint(3, 8)}
    elif kind == "stop":
        extra = {"stop": [".", "\n"], "max_tokens": 16}
    elif kind == "session":
        extra = {"max_tokens": 6, "extra_body": {"session_id": session_id}}
    elif kind == "tools":
        extra = {"tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 40}
        common["messages"] = [{"role": "user", "content": "What's the weather in Paris?"}]
    else:
        extra = {"max_tokens": rng.randint(2, 12)}
    raw = chat.create(**common, **extra)
    return Sent(kind, raw.headers["x-request-id"], raw.parse().usage.model_dump())


def test_ledger_equals_engine_counts_under_load(start_server, pg_url):
    with start_server(database_url=pg_url) as server:
        client = server.client("all", timeout=300)
        sessions = [httpx.post(f"{server.base_url}/v1/sessions", json={"model": MODEL}, timeout=30,
                               headers={"Authorization": f"Bearer {server.keys['all']}"}).json()["id"]
                    for _ in range(8)]
        rng = random.Random(11)
        kinds = (["plain"] * 30 + ["stream"] * 25 + ["disconnect"] * 12 + ["n2"] * 15 + ["stop"] * 15
                 + ["session"] * 20 + ["tools"] * 3)[:NUM_REQUESTS]
        rng.shuffle(kinds)
        engine = server.services.engine
        before = engine.stats()

        def worker(lane: int) -> list[Sent]:
            lane_rng = random.Random(lane)
            # A lane owns one session, so its turns never overlap (overlap is the 409 test's business).
            return [_one(client, kind, lane_rng, sessions[lane % len(sessions)]) for kind in kinds[lane::8]]

        with ThreadPoolExecutor(8) as pool:
            sent = [s for lane in pool.map(worker, range(8)) for s in lane]
        meter = next(r.meter for r in server.services.extensions.usage_recorders if hasattr(r, "meter"))
        _settle(engine, meter, before, len(sent))
        after = engine.stats()
        with server.services.db_sessions() as db:
            rows = {row.request_id: row for row in db.scalars(select(UsageEventRow))}

    assert len(sent) == NUM_REQUESTS
    assert set(rows) == {s.request_id for s in sent}, "exactly one event per request"
    for s in sent:
        row = rows[s.request_id]
        if s.usage is None:
            assert row.status == "aborted", (s, row.status)
            continue
        assert (row.input_tokens, row.cached_input_tokens, row.output_tokens, row.thinking_tokens) == (
            s.usage["prompt_tokens"], s.usage["prompt_tokens_details"]["cached_tokens"],
            s.usage["completion_tokens"], s.usage["completion_tokens_details"]["reasoning_tokens"]), s
        assert row.status in {"completed", "stopped", "length"}
    assert sum(r.input_tokens for r in rows.values()) == after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert sum(r.output_tokens for r in rows.values()) == (
        after["generation_tokens_total"] - before["generation_tokens_total"])
    assert sum(r.status == "aborted" for r in rows.values()) == kinds.count("disconnect")


def _settle(engine, meter, before: dict, num_requests: int) -> None:
    """Aborted streams finish on the server after the client has left: wait for the engine to idle."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and meter.flush(5) and \
                meter.stats.num_written >= num_requests:
            return
        time.sleep(0.2)
    raise AssertionError("server did not settle")
