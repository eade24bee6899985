"""Exactly-once billing through real `loraplex serve` processes on a private PostgreSQL.

Every request a client saw answered must end as exactly one ledger row whose
token counts equal the `usage` of that answer, across

1. the database stopped and restarted while requests are being generated, and
2. the server SIGKILLed under load, at a moment when answered requests'
   events are provably not in the ledger yet (its table is locked, so the
   server's ledger write hangs), and restarted on the same database, data
   directory and Redis prefix, once with the Redis-stream journal and once
   with the local-file journal (no Redis).

Both tests talk to the server only as clients do (the `openai` SDK); the
ledger is read straight from the database. The request id of an answer is its
`x-request-id` header, which is the ledger's key.

What the server does with the database down (found by these tests, not
assumed): requests admitted before it went away keep generating and are
answered; a request arriving during the outage is served if its API key is
in the server's key cache (it was used recently), and refused (503) if not.
Before the key cache (commit 0b1c63e) every arriving request got a 500
without an `x-request-id` header, because authentication read the database.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest
from loraplex.billing.events import UsageStatus
from loraplex.billing.models import UsageEventRow
from loraplex.platform.auth import store
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.db import migrate
from private_postgres import PrivatePostgres
from server_process import ServerProcess, server_env
from sqlalchemy import create_engine, exc, select
from sqlalchemy.orm import Session
from waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["cats", "rain", "the moon", "bread", "rivers", "music", "snow", "trains", "apples", "clocks"]
JOURNAL_LEASE_S = 2              # a killed server's Redis journal is adopted this long after it died
LEDGER_DEADLINE_S = 60
ANSWERED_STATUSES = {UsageStatus.COMPLETED, UsageStatus.STOPPED, UsageStatus.LENGTH}

Counts = tuple[int, int, int, int]  # input, cached input, output, thinking


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    key_id: str
    key: str
    unused_key: str  # never sent before the outage, so no server has it cached


@dataclass(frozen=True, slots=True)
class Spec:
    index: int
    stream: bool
    max_tokens: int
    ignore_eos: bool = False


@dataclass(slots=True)
class Sent:
    spec: Spec
    request_id: str | None = None   # known once the response headers arrived
    usage: Counts | None = None     # set only for a complete answer (streams: [DONE] seen)
    seen_usage: Counts | None = None  # a stream's usage chunk, even if [DONE] never came
    error: str | None = None
    status_code: int | None = None
    finished_at: float = 0.0        # time.monotonic() when the client was done with it

    @property
    def completed(self) -> bool:
        return self.usage is not None and self.error is None


def _counts(usage: Any) -> Counts:
    return (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
            usage.completion_tokens, usage.completion_tokens_details.reasoning_tokens)


def _row_counts(row: UsageEventRow) -> Counts:
    return (row.input_tokens, row.cached_input_tokens, row.output_tokens, row.thinking_tokens)


def send(client: openai.OpenAI, spec: Spec) -> Sent:
    sent = Sent(spec)
    messages = [{"role": "user", "content": f"Write about {TOPICS[spec.index % len(TOPICS)]} in one line. ({spec.index})"}]
    common: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": spec.max_tokens,
                              "temperature": 0, "extra_body": {"ignore_eos": spec.ignore_eos}}
    chat = client.chat.completions.with_raw_response
    try:
        if spec.stream:
            raw = chat.create(**common, stream=True, stream_options={"include_usage": True})
            sent.request_id = raw.headers["x-request-id"]
            for chunk in raw.parse():
                if chunk.usage is not None:
                    sent.seen_usage = _counts(chunk.usage)
            sent.usage = sent.seen_usage  # the SDK's iteration ended at [DONE]
        else:
            raw = chat.create(**common)
            sent.request_id = raw.headers["x-request-id"]
            sent.usage = _counts(raw.parse().usage)
    except openai.APIStatusError as error:
        sent.status_code = error.status_code
        sent.request_id = error.response.headers.get("x-request-id")
        sent.error = f"{error.status_code}: {error.message}"
    except Exception as error:  # the server died mid-answer, or was not there
        sent.error = repr(error)
    sent.finished_at = time.monotonic()
    return sent


def make_specs(first_index: int, count: int, *, seed: int, max_tokens: tuple[int, int] = (4, 12),
               ignore_eos: bool = False) -> list[Spec]:
    rng = random.Random(seed)
    return [Spec(index=i, stream=i % 2 == 1, max_tokens=rng.randint(*max_tokens), ignore_eos=ignore_eos)
            for i in range(first_index, first_index + count)]


class Load:
    """Requests sent by a pool of threads; `results` fills in as answers (or failures) come back."""

    def __init__(self, client: openai.OpenAI, specs: list[Spec], num_threads: int) -> None:
        self._client = client
        self._specs: queue.SimpleQueue[Spec] = queue.SimpleQueue()
        for spec in specs:
            self._specs.put(spec)
        self._halted = threading.Event()
        self._lock = threading.Lock()
        self.results: list[Sent] = []
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while not self._halted.is_set():
            try:
                spec = self._specs.get_nowait()
            except queue.Empty:
                return
            sent = send(self._client, spec)
            with self._lock:
                self.results.append(sent)

    @property
    def num_completed(self) -> int:
        with self._lock:
            return sum(s.completed for s in self.results)

    @property
    def num_done(self) -> int:
        with self._lock:
            return len(self.results)

    def halt(self) -> None:
        """Send nothing more; requests already sent run to their end."""
        self._halted.set()

    def join(self, timeout_s: float = 180) -> list[Sent]:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in self._threads), "load threads did not finish"
        return list(self.results)


def run_load(client: openai.OpenAI, specs: list[Spec], num_threads: int = 6) -> list[Sent]:
    return Load(client, specs, num_threads).join()


def start_admitted(server: ServerProcess, client: openai.OpenAI, specs: list[Spec]) -> Load:
    """All of `specs` at once, returning once the server has admitted every one (and none has finished)."""
    load = Load(client, specs, num_threads=len(specs))

    def all_admitted() -> bool:
        return server.health()["inflight"] + load.num_done >= len(specs)

    wait_until(all_admitted, timeout_s=120, what="the batch to be admitted")
    assert load.num_done == 0, "the batch finished before the outage could start: give it more tokens"
    return load


def seed_tenant(database_url: str) -> Tenant:
    from loraplex.platform.db.session import make_db_engine, make_session_factory

    migrate.upgrade(database_url)
    engine = make_db_engine(database_url)
    with make_session_factory(engine)() as db:
        tenant = store.create_tenant(db, name="exactly-once")
        created = store.create_api_key(db, tenant=tenant, scopes=[Scope.INFERENCE, Scope.USAGE], name="load")
        unused = store.create_api_key(db, tenant=tenant, scopes=[Scope.INFERENCE], name="unused")
        seeded = Tenant(tenant_id=tenant.id, key_id=created.record.id, key=created.key, unused_key=unused.key)
    engine.dispose()
    return seeded


@contextmanager
def ledger_reader(database_url: str) -> Iterator[Callable[[], dict[str, UsageEventRow]]]:
    engine = create_engine(database_url, pool_pre_ping=True)

    def read() -> dict[str, UsageEventRow]:
        with Session(engine, expire_on_commit=False) as db:
            rows = list(db.scalars(select(UsageEventRow)))
        by_id = {row.request_id: row for row in rows}
        assert len(by_id) == len(rows), "two ledger rows share a request id"
        return by_id

    try:
        yield read
    finally:
        engine.dispose()


def wait_for_ledger(read: Callable[[], dict[str, UsageEventRow]], request_ids: set[str]) -> None:
    """Poll until every id is in the ledger (the writers drain journals in the background)."""
    missing = set(request_ids)

    def all_written() -> bool:
        nonlocal missing
        try:
            missing = request_ids - set(read())
        except exc.OperationalError:
            missing = set(request_ids)
        return not missing

    wait_until(all_written, timeout_s=LEDGER_DEADLINE_S, interval_s=0.2,
               what=lambda: f"{len(missing)} answered requests to reach the ledger: {sorted(missing)[:10]}")


class Clock:
    """Seconds per phase, printed with the test's output (the module must stay fast on a 2-core box)."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self.phases: list[str] = []

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append(f"{phase} {now - self._last:.1f}s")
        self._last = now

    def __str__(self) -> str:
        return ", ".join(self.phases)


def client_for(server: ServerProcess, tenant: Tenant, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key or tenant.key, max_retries=0, timeout=120)


def assert_billed_exactly(rows: dict[str, UsageEventRow], answered: list[Sent], tenant: Tenant) -> None:
    """Each answered request: one row, with the answer's own counts, status and owner."""
    for sent in answered:
        row = rows.get(sent.request_id or "")
        assert row is not None, f"answered request {sent.request_id} was not billed"
        assert _row_counts(row) == sent.usage, (sent, _row_counts(row))
        assert row.status in ANSWERED_STATUSES, (sent, row.status)
        assert (row.tenant_id, row.api_key_id) == (tenant.tenant_id, tenant.key_id)


def spend_counter_tokens(redis_client: Any, prefix: str, tenant_id: str) -> int:
    month = datetime.now(UTC).strftime("%Y-%m")
    return int(redis_client.hget(f"{prefix}billing:spend:{month}:{tenant_id}:*", "tokens") or 0)


# ---- 1. the database goes away while requests are generating --------------------------------------

def test_database_outage_under_load(private_postgres: PrivatePostgres, redis_url: str, key_prefix: str,
                                    redis_client: Any, smollm_path: Path, tmp_path: Path) -> None:
    """Load; PostgreSQL stopped (`pg_ctl stop -m fast`) under load for a while; started again; more load.

    The database stops while a batch of admitted requests is generating
    (streams: their headers arrived; all: the server's /healthz `inflight`);
    more requests arrive and are answered during the outage (the key is in
    the server's key cache), and a never-used key is refused. Every answer of
    the outage can only have been metered into the server's journal. Then the
    database comes back and more load follows. The ledger must end with
    exactly the answered requests, each with its own counts (nothing for the
    refused one), and the Redis spend counter (quota) must have counted each
    event once.
    """
    tenant = seed_tenant(private_postgres.url)
    # No batch work is sent: an idle batch-worker process costs each start ~10 CPU-seconds of a 2-core box.
    env = server_env(database_url=private_postgres.url, data_dir=tmp_path / "data", model_path=smollm_path,
                     redis_url=redis_url, redis_key_prefix=key_prefix, billing_journal_lease_s=JOURNAL_LEASE_S,
                     batch_workers_enabled=False)
    clock = Clock()
    with ServerProcess(env, tmp_path, name="outage") as server, ledger_reader(private_postgres.url) as read:
        server.start()
        clock.lap("start")
        client = client_for(server, tenant)
        before = run_load(client, make_specs(0, 20, seed=1))
        clock.lap("load")

        generating = start_admitted(server, client, make_specs(100, 8, seed=2, max_tokens=(16, 16), ignore_eos=True))
        private_postgres.stop("fast")
        db_stopped_at = time.monotonic()
        arrived = run_load(client, make_specs(300, 10, seed=4), num_threads=4)
        refused = send(client_for(server, tenant, tenant.unused_key), Spec(index=999, stream=False, max_tokens=4))
        during = generating.join()
        private_postgres.start()
        clock.lap("outage")

        after = run_load(client, make_specs(200, 10, seed=3))
        clock.lap("load")
        answered = [*before, *during, *arrived, *after]
        assert [s for s in answered if not s.completed] == [], "requests failed (database up, or key cached)"
        wait_for_ledger(read, {s.request_id for s in answered if s.request_id})
        clock.lap("ledger")
        assert server.terminate(), "the server did not shut down cleanly"
        rows = read()
    print(f"outage: {clock}")
    print(f"outage: a never-used key during the outage got {refused.status_code} ({refused.error})")

    while_down = [s for s in [*during, *arrived] if s.finished_at > db_stopped_at]
    assert len(while_down) > len(arrived), "no admitted request was still generating when the database stopped"
    print(f"outage: {len(answered)} answered, {len(while_down)} of them while the database was down")
    assert not refused.completed and refused.status_code is not None, refused
    assert refused.request_id is not None and refused.request_id not in rows, "a refused request was billed"
    assert_billed_exactly(rows, answered, tenant)
    assert set(rows) == {s.request_id for s in answered}, "rows for requests that were never answered"
    assert spend_counter_tokens(redis_client, key_prefix, tenant.tenant_id) == sum(
        row.input_tokens + row.output_tokens for row in rows.values()), "quota spend counted an event twice"


# ---- 2. the server is killed under load and comes back --------------------------------------------

@contextmanager
def ledger_locked(dsn: str) -> Iterator[None]:
    """A SHARE lock on the ledger table: reads go on, every INSERT waits (a ledger that hangs mid-write)."""
    connection = psycopg.connect(dsn)
    try:
        connection.execute("LOCK TABLE billing_usage_events IN SHARE MODE")
        yield
    finally:
        connection.rollback()
        connection.close()


@pytest.mark.parametrize("journal", ["redis", "file"])
def test_sigkill_under_load_then_restart(journal: str, private_postgres: PrivatePostgres, redis_url: str,
                                         key_prefix: str, redis_client: Any, smollm_path: Path,
                                         tmp_path: Path) -> None:
    """Concurrent load; SIGKILL while answered events are provably not in the ledger; restart; catch up.

    Life A: 6 client threads with the database up. After 8 answers the test
    locks the ledger table (SHARE: the server's ledger INSERT hangs inside its
    transaction), waits for 8 more answers, reads the ledger (reads are not
    blocked) and SIGKILLs the server with requests in flight. The answers
    missing from that read existed only in the server's journal when it died:
    this is what makes the test prove the journal matters (an event held in
    memory until the ledger takes it would be lost). The lock is released
    after the kill; the killed INSERT never commits.
    Life B: a new process on the same database, data directory and Redis
    prefix adopts A's journal (the file segment at once; the Redis stream once
    A's lease expires, 2 s here), serves a few more requests, and the ledger
    catches up.

    Then: every answered request has exactly one row with its own counts.
    Requests cut off by the kill may or may not have a row (the server may
    have journaled a finished request whose last bytes never left), but such a
    row must belong to a request that was in flight (a stream whose id we saw,
    or one of the non-streamed requests whose answer never came, whose ids we
    cannot know), with counts that request could have produced; nothing else
    may be in the ledger. With Redis, the quota spend counter must not exceed
    the ledger (a re-delivered event counted twice would); it may fall short
    by a kill between a ledger commit and the counter update, which the
    reconcile task repairs.
    """
    tenant = seed_tenant(private_postgres.url)
    redis_settings = {"redis_url": redis_url, "redis_key_prefix": key_prefix} if journal == "redis" else {}
    env = server_env(database_url=private_postgres.url, data_dir=tmp_path / "data", model_path=smollm_path,
                     billing_journal_lease_s=JOURNAL_LEASE_S, batch_workers_enabled=False,  # none sent (see above)
                     **redis_settings)
    clock = Clock()
    with ServerProcess(env, tmp_path, name=f"killed-{journal}") as server, \
            ledger_reader(private_postgres.url) as read:
        server.start()  # A
        clock.lap("start A")
        load = Load(client_for(server, tenant), make_specs(0, 60, seed=4), num_threads=6)
        wait_until(lambda: load.num_completed >= 8, timeout_s=120, what="8 answers")
        with ledger_locked(private_postgres.dsn):
            wait_until(lambda: load.num_completed >= 16, timeout_s=60, what="8 answers while the ledger hangs")
            load.halt()
            in_ledger_at_kill = set(read())
            answered_at_kill = {s.request_id for s in load.results if s.completed}
            server.kill()
        life_a = load.join()
        clock.lap("load A")

        server.start()  # B
        clock.lap("start B")
        life_b = run_load(client_for(server, tenant), make_specs(200, 6, seed=6), num_threads=3)
        clock.lap("load B")
        answered = [s for s in [*life_a, *life_b] if s.completed]
        wait_for_ledger(read, {s.request_id for s in answered if s.request_id})
        clock.lap("ledger")
        assert server.terminate(), "the server did not shut down cleanly"
        rows = read()
    print(f"{journal}: {clock}")

    journal_only = answered_at_kill - in_ledger_at_kill
    assert journal_only, "every answer was in the ledger when the server died: the kill proved nothing"
    cut_off = [s for s in life_a if not s.completed]
    assert cut_off, "the kill landed when nothing was in flight: it proved nothing"
    assert all(s.completed for s in life_b), [s for s in life_b if not s.completed]
    assert_billed_exactly(rows, answered, tenant)

    answered_ids = {s.request_id for s in answered}
    extra = {request_id: row for request_id, row in rows.items() if request_id not in answered_ids}
    cut_by_id = {s.request_id: s for s in cut_off if s.request_id}
    num_cut_without_id = sum(1 for s in cut_off if not s.request_id)
    unknown = [row for request_id, row in extra.items() if request_id not in cut_by_id]
    assert len(unknown) <= num_cut_without_id, f"rows for requests never sent: {[r.request_id for r in unknown]}"
    for request_id, row in extra.items():
        sent_one = cut_by_id.get(request_id)
        max_tokens = sent_one.spec.max_tokens if sent_one else max(s.spec.max_tokens for s in cut_off)
        assert (row.tenant_id, row.api_key_id) == (tenant.tenant_id, tenant.key_id)
        assert row.cached_input_tokens <= row.input_tokens and row.thinking_tokens <= row.output_tokens <= max_tokens
        if sent_one is not None and sent_one.seen_usage is not None:
            assert _row_counts(row) == sent_one.seen_usage, (sent_one, _row_counts(row))

    ledger_tokens = sum(row.input_tokens + row.output_tokens for row in rows.values())
    answered_tokens = sum(s.usage[0] + s.usage[2] for s in answered if s.usage)
    assert ledger_tokens == answered_tokens + sum(r.input_tokens + r.output_tokens for r in extra.values())
    print(f"{journal}: {len(answered)} answered ({len(journal_only)} only in the journal at the kill), "
          f"{len(cut_off)} cut off by the kill, {len(extra)} of those billed")
    if journal == "redis":
        assert spend_counter_tokens(redis_client, key_prefix, tenant.tenant_id) <= ledger_tokens
