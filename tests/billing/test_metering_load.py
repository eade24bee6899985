"""Metering under load through the real server (ledger on PostgreSQL), with the openai client.

120 requests run from 12 concurrent lanes: plain, streamed, n=2, stop strings,
session turns, the trained `pirate` adapter, the trained `thinker` with and without
a thinking budget, forced tool calls and /v1/completions; 12 of them (10%) are
streams the client drops mid-way (see metering_load_traffic.MIX). Then: one
ledger event per request; each completed request's event equals the usage the
server returned, names its adapter and session; the dropped ones are aborted;
and the ledger's totals of input, output and thinking tokens equal the engine's
own counters.

The engine is shared by the whole test session, so its counters are compared
as deltas.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from adapter_upload import upload_adapter
from log_capture import captured_logs
from loraplex.billing.models import UsageEventRow
from metering_load_traffic import MIX, MODEL, Sent, send, shuffled_kinds
from sqlalchemy import select
from waiting import wait_until

NUM_REQUESTS = 120
NUM_DROPPED = 12
NUM_LANES = 12


@pytest.fixture
def server_logs():
    """Warnings and errors of the in-process server; uvicorn's own loggers do not reach the root."""
    with captured_logs("uvicorn", level=logging.WARNING) as kept:
        yield kept.records


def _new_session(server) -> str:
    created = httpx.post(f"{server.base_url}/v1/sessions", json={"model": MODEL}, timeout=30,
                         headers={"Authorization": f"Bearer {server.keys['all']}"})
    assert created.status_code == 200, created.text
    return created.json()["id"]


def test_ledger_equals_engine_counts_under_load(start_server, pg_url, smollm_path, server_logs):
    from train_adapters import ensure_trained_adapters

    trained = ensure_trained_adapters(smollm_path)
    kinds = shuffled_kinds(seed=11)
    assert (len(kinds), sum(k.drop for k in kinds)) == (NUM_REQUESTS, NUM_DROPPED)
    with start_server(database_url=pg_url) as server:
        adapter_ids = {name: upload_adapter(server, name, trained[name]) for name in ("pirate", "thinker")}
        tokenizer = server.services.tokenizer
        marker_lens = [len(tokenizer.encode(m, add_special_tokens=False)) for m in ("<think>", "</think>")]
        client = server.client("all", timeout=300)
        lane_sessions = [_new_session(server) for _ in range(NUM_LANES)]
        engine = server.services.engine
        before = engine.stats()
        started = time.monotonic()

        def worker(lane: int) -> list[Sent]:
            rng = random.Random(lane)
            sent = []
            for kind in kinds[lane::NUM_LANES]:
                # A lane owns one session, so its turns never overlap (overlap is the 409 test's business);
                # a dropped turn gets a session of its own, as its abort lands after the client has moved on.
                session = lane_sessions[lane] if kind.session == "lane" else None
                if kind.session == "own":
                    session = _new_session(server)
                sent.append(send(client, kind, rng, session))
            return sent

        with ThreadPoolExecutor(NUM_LANES) as pool:
            sent = [s for lane in pool.map(worker, range(NUM_LANES)) for s in lane]
        meter = next(r.meter for r in server.services.extensions.usage_recorders if hasattr(r, "meter"))
        _settle(engine, meter, len(sent))
        elapsed = time.monotonic() - started
        after = engine.stats()
        with server.services.db_sessions() as db:
            rows = {row.request_id: row for row in db.scalars(select(UsageEventRow))}
        for session_id in {s.session_id for s in sent if s.session_id}:  # unpin their KV in the shared engine
            assert httpx.delete(f"{server.base_url}/v1/sessions/{session_id}", timeout=30,
                                headers={"Authorization": f"Bearer {server.keys['all']}"}).status_code == 200

    print(f"\n{len(sent)} requests settled in {elapsed:.1f}s: "
          + ", ".join(f"{k.name}={k.count}" for k in MIX))
    assert len(sent) == NUM_REQUESTS and len({s.request_id for s in sent}) == NUM_REQUESTS
    assert len(rows) == NUM_REQUESTS and set(rows) == {s.request_id for s in sent}, "exactly one event per request"
    for s in sent:
        row = rows[s.request_id]
        assert row.adapter_id == adapter_ids.get(s.kind.model), (s, row.adapter_id)
        assert row.session_id == s.session_id, (s, row.session_id)
        assert row.thinking_tokens <= row.output_tokens <= s.max_output_tokens, (s, row.output_tokens)
        if s.kind.drop:
            _check_dropped(s, row)
        else:
            _check_completed(s, row, marker_lens)
    assert sum(r.input_tokens for r in rows.values()) == after["prompt_tokens_total"] - before["prompt_tokens_total"]
    # Tokens the engine generated past a stop string the API server matched are never delivered or billed:
    # counted as discarded when the stop reaches a running request, and otherwise (the request had already
    # ended in the engine) only bounded by what those requests could still have generated.
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    discarded = after["discarded_tokens_total"] - before["discarded_tokens_total"]
    unbilled = generated - discarded - sum(r.output_tokens for r in rows.values())
    stopped_here = [s for s in sent if "stop" in (s.finish_reasons or [])]
    assert 0 <= unbilled <= sum(s.max_output_tokens - rows[s.request_id].output_tokens for s in stopped_here)
    assert sum(r.thinking_tokens for r in rows.values()) == (
        after["reasoning_tokens_total"] - before["reasoning_tokens_total"])
    assert sum(rows[s.request_id].thinking_tokens for s in sent if s.kind.drop) > 0, "no dropped stream was thinking"
    assert sum(r.status == "aborted" for r in rows.values()) == NUM_DROPPED
    assert any(s.finish_reasons == ["tool_calls"] for s in sent), "no forced tool call finished"
    noisy = [f"{r.name} {r.levelname}: {r.getMessage()}" for r in server_logs
             if r.levelno >= logging.ERROR or r.name.startswith("loraplex")]
    assert not noisy, noisy


def _check_completed(s: Sent, row: UsageEventRow, marker_lens: list[int]) -> None:
    usage = s.usage
    assert usage is not None, f"{s.kind.name}: no usage came back"
    reasoning = usage["completion_tokens_details"]["reasoning_tokens"]
    assert (row.input_tokens, row.cached_input_tokens, row.output_tokens, row.thinking_tokens) == (
        usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"],
        reasoning), s
    assert row.status in {"completed", "stopped", "length"}, (s, row.status)
    assert len(s.finish_reasons) == s.kind.n, s
    if s.kind.model == "thinker":
        start_len, end_len = marker_lens
        if s.budget is None or s.budget > 0:
            assert reasoning > 0, s
        if s.budget is not None:
            assert reasoning <= max(s.budget, start_len) + end_len, s
    if s.kind.model == "pirate":
        assert s.text.startswith("Arr"), s  # the adapter really ran
    if s.finish_reasons[0] == "tool_calls":
        assert s.num_tool_calls == 1, s


def _check_dropped(s: Sent, row: UsageEventRow) -> None:
    assert s.usage is None, s
    assert row.status == "aborted", (s, row.status)
    # The engine made at least what the client read before leaving, and it stopped before max_tokens.
    assert s.num_text_chunks <= row.output_tokens < s.max_output_tokens, (s, row.output_tokens)
    assert s.num_reasoning_chunks <= row.thinking_tokens, (s, row.thinking_tokens)


def _settle(engine, meter, num_requests: int) -> None:
    """Aborted streams finish on the server after the client has left: wait for the engine to idle."""

    def settled() -> bool:
        stats = engine.stats()
        return (stats["num_running"] == 0 and stats["num_waiting"] == 0 and meter.flush(5)
                and meter.stats.num_written >= num_requests)

    wait_until(settled, timeout_s=60, interval_s=0.2, what=lambda: f"the server to settle: {engine.stats()}")
