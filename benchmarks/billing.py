"""Billing benchmark: metering overhead per request, and ledger write throughput on PostgreSQL.

1. Ledger throughput: N usage events written to a fresh PostgreSQL database
   by `Ledger.write` in batches (the meter's writer path: price lookup,
   INSERT ... ON CONFLICT DO NOTHING RETURNING). Checked first: every event
   is stored once, token sums match, and replaying the whole set inserts
   nothing. Also the same through `Meter.record` end to end (journal → writer → ledger).
2. Metering overhead: a real server (SmolLM2, SQLite ledger) under the same
   concurrent load, per repeat once with each journal and once with metering
   off, in rotating order: the Redis-stream journal (production: Redis is
   configured) and the fsynced-file journal (no Redis). The request-path cost
   of metering is the platform's end-of-request call into the recorder:
   build the UsageEvent and wait until it is durable in the journal (the
   meter group-commits, so concurrent requests share one round trip or
   fsync). It is timed around every call (p50, p99). End-to-end latency of
   each variant is reported beside it; on a shared 2-core CPU differences
   between them are within the run-to-run noise.

    python benchmarks/billing.py           # full: writes benchmarks/results/billing.json
    python benchmarks/billing.py --quick   # small sizes; writes nothing
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import tempfile
import time
import uuid
from contextlib import contextmanager
from datetime import UTC
from pathlib import Path
from typing import Any

from loraplex.engine.host_info import cpu_benchmark_machine

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "billing.json"
PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
MODEL = "SmolLM2-135M-Instruct"


@contextmanager
def fresh_postgres() -> Any:
    import psycopg

    name = f"lpx_bench_billing_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_URL.format(name=name)
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def make_events(n: int) -> list[Any]:
    from loraplex.billing.events import UsageEvent

    now = datetime.datetime.now(UTC)
    return [UsageEvent(request_id=f"req_{uuid.uuid4().hex}", tenant_id=f"ten_{i % 7}", model=MODEL,
                       status="completed", created_at=now, api_key_id=f"key_{i % 13}",
                       adapter_id=None if i % 3 else f"ad_{i % 5}", input_tokens=100 + i % 400,
                       cached_input_tokens=i % 100, output_tokens=20 + i % 80, thinking_tokens=i % 20,
                       ttft_ms=12.0, duration_ms=80.0) for i in range(n)]


def ledger_throughput(n: int, batch: int) -> dict[str, float]:
    from loraplex.billing.ledger import Ledger
    from loraplex.billing.meter import Meter
    from loraplex.billing.models import BillingBase, UsageEventRow
    from loraplex.billing.pricing import add_price
    from loraplex.billing.spool import FileSpool
    from sqlalchemy import create_engine, func, select
    from sqlalchemy.orm import sessionmaker

    with fresh_postgres() as url:
        engine = create_engine(url, pool_size=4)
        BillingBase.metadata.create_all(engine)
        factory = sessionmaker(engine, expire_on_commit=False)
        with factory() as session, session.begin():
            add_price(session, model="*", input_usd_per_mtok="0.1", output_usd_per_mtok="0.4",
                      effective_from=datetime.datetime(2020, 1, 1, tzinfo=UTC))
        ledger = Ledger(factory)
        warm_up = make_events(50)
        ledger.write(warm_up)  # connections, price book, statement cache
        events = make_events(n)
        start = time.perf_counter()
        inserted = sum(len(ledger.write(events[i:i + batch]).inserted) for i in range(0, n, batch))
        direct_s = time.perf_counter() - start
        replayed = sum(len(ledger.write(events[i:i + batch]).inserted) for i in range(0, n, batch))
        with factory() as session:
            count, tokens = session.execute(select(
                func.count(), func.sum(UsageEventRow.input_tokens + UsageEventRow.output_tokens))).one()
        expected = 50 + n
        assert inserted == n and replayed == 0, (inserted, replayed)
        assert count == expected, count
        assert tokens == sum(e.total_tokens for e in [*warm_up, *events]), tokens

        with tempfile.TemporaryDirectory() as spool_dir:
            meter = Meter(ledger, spools=[FileSpool(spool_dir)], batch_size=batch)
            meter.start()
            events = make_events(n)
            start = time.perf_counter()
            for event in events:
                meter.record(event)
            assert meter.wait_written(600)
            meter_s = time.perf_counter() - start
            meter.close()
            assert meter.stats.num_written == n and meter.num_pending_spooled() == 0
        engine.dispose()
    return {"ledger_writes_per_s_postgres": n / direct_s, "meter_events_per_s_postgres": n / meter_s}


class TimedRecorder:
    """Wraps the platform's recorder to time the request-path part of metering (build + enqueue)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.meter = inner.meter
        self.times_ms: list[float] = []

    async def record(self, record: Any) -> None:
        start = time.perf_counter()
        await self.inner.record(record)
        self.times_ms.append((time.perf_counter() - start) * 1000)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


VARIANTS = ("redis-journal", "file-journal", "off")


def metering_overhead(num_requests: int, concurrency: int, repeats: int) -> dict[str, Any]:
    import openai
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.model.default_model import ensure_default_model

    path = ensure_default_model(ROOT / "data" / "models")
    engine = AsyncEngine.from_model_path(path, EngineConfig(max_model_len=1024, max_num_seqs=32, dtype="float32"))
    latencies: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    recorded_ms: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    answers: dict[str, list[str]] = {}
    try:
        for repeat in range(repeats):
            order = VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]  # each variant runs first once in three
            for variant in order:
                with serve(engine, variant=variant) as (base_url, key, app):
                    timed = None
                    if variant != "off":
                        recorders = app.state.services.extensions.usage_recorders
                        timed = TimedRecorder(recorders[0])
                        recorders[0] = timed
                    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
                    texts, times = asyncio.run(load(client, num_requests, concurrency))
                    if timed is not None:
                        assert timed.meter.wait_written(60)
                        assert timed.meter.stats.num_written == num_requests, "one ledger event per request"
                        recorded_ms[variant] += timed.times_ms
                    latencies[variant] += times
                    answers[variant] = texts
        assert all(texts == answers["off"] for texts in answers.values()), "metering must not change answers"
    finally:
        engine.shutdown()
    redis, file = recorded_ms["redis-journal"], recorded_ms["file-journal"]
    return {
        "metering_overhead_ms_p50": percentile(redis, 0.5),
        "metering_overhead_ms_p99": percentile(redis, 0.99),
        "metering_overhead_file_journal_ms_p50": percentile(file, 0.5),
        "metering_overhead_file_journal_ms_p99": percentile(file, 0.99),
        **{f"latency_ms_p50_{v.replace('-', '_')}": percentile(latencies[v], 0.5) for v in VARIANTS},
        **{f"latency_ms_p99_{v.replace('-', '_')}": percentile(latencies[v], 0.99) for v in VARIANTS},
        "requests_measured": len(redis) + len(file),
    }


async def load(client: Any, num_requests: int, concurrency: int) -> tuple[list[str], list[float]]:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[str, float]:
        async with semaphore:
            start = time.perf_counter()
            answer = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Say a word about the number {i % 10}."}],
                max_tokens=2, temperature=0)
            return answer.choices[0].message.content, (time.perf_counter() - start) * 1000

    async with client:  # closed on this loop (asyncio.run closes the loop right after)
        results = await asyncio.gather(*(one(i) for i in range(num_requests)))
    return [r[0] for r in results], [r[1] for r in results]


@contextmanager
def serve(engine: Any, *, variant: str) -> Any:
    import socket
    import threading

    import uvicorn
    from loraplex.platform.app import create_app
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.db import migrate
    from loraplex.platform.db.session import make_db_engine, make_session_factory
    from loraplex.platform.settings import Settings

    with tempfile.TemporaryDirectory() as data_dir:
        # Redis (rate limits, sessions) is configured for every variant but the file journal's, whose point is
        # the no-Redis deployment; metering's own cost is what the recorder timing isolates.
        redis = {} if variant == "file-journal" else {
            "redis_url": "redis://127.0.0.1:6379/0", "redis_key_prefix": f"lpxbench:{uuid.uuid4().hex[:8]}:"}
        settings = Settings(data_dir=Path(data_dir), metering_enabled=variant != "off", default_rpm=0,
                            default_tpm=0, **redis)
        migrate.upgrade(settings.resolved_database_url)
        db_engine = make_db_engine(settings.resolved_database_url)
        with make_session_factory(db_engine)() as db:
            tenant = store.create_tenant(db, name="bench")
            key = store.create_api_key(db, tenant=tenant, scopes=[Scope.INFERENCE], name="bench").key
        db_engine.dispose()
        app = create_app(settings, engine=engine)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}", key, app
        finally:
            server.should_exit = True
            thread.join(30)
            if redis:
                _delete_keys(redis["redis_url"], redis["redis_key_prefix"])


def _delete_keys(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; writes nothing")
    args = parser.parse_args()

    n_events, n_requests, repeats = (2_000, 24, 1) if args.quick else (50_000, 96, 3)
    ledger = ledger_throughput(n_events, batch=256)
    overhead = metering_overhead(n_requests, concurrency=8, repeats=repeats)
    metrics = {**ledger, **overhead}
    for name, value in metrics.items():
        print(f"{name:<36}{value:>14.3f}" if isinstance(value, float) else f"{name:<36}{value:>14}")
    if args.quick:
        return
    result = {
        "benchmark": "billing",
        "date": datetime.datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": MODEL, "ledger_events": n_events, "ledger_batch": 256, "requests_per_run": n_requests,
                   "concurrency": 8, "repeats": repeats, "database": "PostgreSQL (local)",
                   "journal": "write-ahead: Redis stream (overhead p50/p99) and fsynced file (file_journal)"},
        "metrics": metrics,
        "targets": {},
        "checked": True,
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
