"""Two `loraplex serve` replicas behind Debian's HAProxy (deploy/haproxy/haproxy.cfg, as shipped) on one
PostgreSQL, one Redis and one adapter folder, with a Celery worker: everything started by the test.

- an adapter uploaded through the balancer is validated by the worker and serves on both replicas, and
  deleting it through one stops it on both at once;
- a session's turns stay on one replica (its cached tokens grow every turn);
- a budget shared by concurrent requests through both replicas overspends by at most one reservation;
- a key revoked through one replica is refused by the other within a second;
- killing the replica a session lives on moves its next turn to the other: answered as the whole
  conversation sent at once would be, counted as moved, and every turn billed exactly once.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from local_serving import free_port
from loraplex.platform.db import migrate
from loraplex.platform.db.session import make_db_engine, make_session_factory
from prometheus_client.parser import text_string_to_metric_families
from replica_helpers import MODEL, bearer, create_tenant, upload_adapter, wait_until, write_adapter
from server_process import ServerProcess, server_env

REPO = Path(__file__).resolve().parents[2]
# Celery's queue is not key-prefixed: a Redis database of this test's own keeps other runs' messages apart.
REDIS_FOR_REPLICAS = os.environ.get("LORAPLEX_TEST_REPLICAS_REDIS_URL", "redis://127.0.0.1:6379/11")
BUDGET_TOKENS = 600
MAX_TOKENS = 24


def _start_celery_worker(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    celery_bin = Path(sys.executable).with_name("celery")
    with log_path.open("wb") as log:
        # cwd outside the repository: celery puts its cwd on sys.path, and the repo root holds `platform/`.
        worker = subprocess.Popen(
            [str(celery_bin), "-A", "loraplex.platform.celery_app:celery", "worker", "--pool=solo",
             "--concurrency=1", "--without-mingle", "--without-gossip", "--loglevel=INFO"],
            cwd=log_path.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    wait_until(lambda: worker.poll() is not None or b"ready." in log_path.read_bytes(), timeout_s=300,
               what=lambda: f"the celery worker:\n{log_path.read_text()[-3000:]}")
    assert worker.poll() is None, log_path.read_text()[-3000:]
    return worker


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(smollm_path: Path, new_postgres_database: Any, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Any]]:
    from loraplex.billing.quotas import set_budget

    tmp = tmp_path_factory.mktemp("two-replicas")
    client = redis.Redis.from_url(REDIS_FOR_REPLICAS)
    client.delete("celery")  # messages an aborted earlier run left in the queue
    prefix = f"lpxtest:replicas:{secrets.token_hex(4)}:"
    with new_postgres_database("loraplex_replicas") as database_url, ExitStack() as stack:
        migrate.upgrade(database_url)
        tenant_id, key, _ = create_tenant(database_url, "acme")
        budget_tenant, budget_key, _ = create_tenant(database_url, "thrifty")
        _, doomed_key, doomed_key_id = create_tenant(database_url, "leaver", scopes=("inference",))
        _, admin_key, _ = create_tenant(database_url, "ops", scopes=("admin",))
        db = make_db_engine(database_url)
        with make_session_factory(db)() as session:
            set_budget(session, tenant_id=budget_tenant, monthly_token_limit=BUDGET_TOKENS)
            session.commit()
        db.dispose()
        storage = tmp / "adapters"  # the one adapter folder both replicas and the worker use
        # No batch work is sent: each replica's idle batch-worker process would cost ~8 CPU-seconds of a 2-core box.
        settings = {"adapter_storage_dir": storage, "api_servers": 1, "max_num_seqs": 8, "kv_cache_memory_mb": 24,
                    "billing_journal_lease_s": 2, "session_busy_wait_s": 5, "batch_workers_enabled": False}
        replicas = []
        for index in (1, 2):
            env = server_env(database_url=database_url, data_dir=tmp / f"replica-{index}", model_path=smollm_path,
                             redis_url=REDIS_FOR_REPLICAS, redis_key_prefix=prefix, replica_id=f"replica-{index}",
                             **settings)
            (tmp / f"replica-{index}").mkdir()
            replicas.append(stack.enter_context(ServerProcess(env, tmp, name=f"replica-{index}")))
        for replica in replicas:
            replica.start(wait=False)
        worker_env = {**replicas[0].env}
        worker = _start_celery_worker(worker_env, tmp / "worker.log")
        stack.callback(_stop, worker)
        for replica in replicas:
            replica.wait_healthy(timeout_s=900)
        lb_port = free_port()
        haproxy_env = {"PATH": os.environ.get("PATH", "") + ":/usr/sbin", "LORAPLEX_LB_BIND": f"127.0.0.1:{lb_port}",
                       "LORAPLEX_LB_LOG": "stdout",
                       "LORAPLEX_REPLICA_1": f"127.0.0.1:{replicas[0].port}",
                       "LORAPLEX_REPLICA_2": f"127.0.0.1:{replicas[1].port}"}
        haproxy_log = (tmp / "haproxy.log").open("wb")
        haproxy = subprocess.Popen(["haproxy", "-db", "-f", str(REPO / "deploy" / "haproxy" / "haproxy.cfg")],
                                   env=haproxy_env, stdout=haproxy_log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        stack.callback(_stop, haproxy)
        lb = f"http://127.0.0.1:{lb_port}"
        wait_until(lambda: httpx.get(lb + "/readyz", timeout=5).status_code == 200, what="haproxy")
        try:
            yield {"lb": lb, "replicas": replicas, "key": key, "tenant_id": tenant_id, "budget_key": budget_key,
                   "doomed_key": doomed_key, "doomed_key_id": doomed_key_id, "admin_key": admin_key,
                   "model_path": smollm_path, "tmp": tmp}
        finally:
            for replica in replicas:
                replica.print_log()
            print((tmp / "worker.log").read_text()[-3000:], (tmp / "haproxy.log").read_text()[-3000:],
                  file=sys.stderr)
    for key_name in client.scan_iter(match=prefix + "*"):
        client.delete(key_name)
    client.close()


def chat(url: str, key: str, content: str | list[dict[str, Any]], *, headers: dict[str, str] | None = None,
         model: str = MODEL, max_tokens: int = MAX_TOKENS, **body: Any) -> httpx.Response:
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return httpx.post(url + "/v1/chat/completions", headers={**bearer(key), **(headers or {})}, timeout=300,
                      json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **body})


def moved_turns(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "loraplex_session_turns_moved")
    return family.samples[0].value


def test_an_adapter_uploaded_through_the_balancer_serves_on_both_replicas(cluster: dict[str, Any]) -> None:
    files = write_adapter(cluster["tmp"] / "pirate", cluster["model_path"], seed=7)
    adapter = upload_adapter(cluster["lb"], cluster["key"], "pirate", files, timeout_s=300)  # the worker validates
    assert adapter["status"] == "ready", adapter
    for replica in cluster["replicas"]:
        answer = chat(replica.url, cluster["key"], "Hello", model="pirate", max_tokens=4)
        assert answer.status_code == 200, answer.text
        models = httpx.get(replica.url + "/v1/models", headers=bearer(cluster["key"])).json()["data"]
        assert {"id": "pirate", "parent": MODEL}.items() <= next(m for m in models if m["id"] == "pirate").items()
    # deleted through one replica, it stops serving on both at once
    first, second = cluster["replicas"]
    deleted = httpx.delete(f"{first.url}/v1/adapters/{adapter['id']}", headers=bearer(cluster["key"]), timeout=60)
    assert deleted.status_code == 200, deleted.text
    for replica in (second, first):
        gone = chat(replica.url, cluster["key"], "Hello", model="pirate", max_tokens=4)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text


def test_a_sessions_turns_stay_on_one_replica(cluster: dict[str, Any]) -> None:
    lb, key = cluster["lb"], cluster["key"]
    created = httpx.post(lb + "/v1/sessions", json={"model": MODEL}, headers=bearer(key), timeout=60)
    session_id = created.headers["x-session-id"]
    before = [moved_turns(r.url) for r in cluster["replicas"]]
    cached, prompts, served_by = [], [], set()
    for turn in ("My name is Ada.", "I live in Paris.", "I like tea.", "What is my name?"):
        answer = chat(lb, key, turn, headers={"x-session-id": session_id})
        assert answer.status_code == 200 and answer.headers["x-session-id"] == session_id, answer.text
        usage = answer.json()["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        prompts.append(usage["prompt_tokens"])
        record = httpx.get(f"{lb}/v1/sessions/{session_id}", headers=bearer(key), timeout=30).json()
        served_by.add(record["replica_id"])
    assert len(served_by) == 1, served_by
    # every turn after the first starts from the KV of the one before: its cached tokens keep growing
    assert all(later > earlier for earlier, later in itertools.pairwise(cached[1:])), cached
    assert all(c >= p - 16 for c, p in zip(cached[1:], prompts, strict=False)), (cached, prompts)
    assert [moved_turns(r.url) for r in cluster["replicas"]] == before


def test_a_shared_budget_overspends_by_at_most_one_reservation(cluster: dict[str, Any]) -> None:
    key = cluster["budget_key"]
    statuses: list[int] = []
    lock = threading.Lock()

    def send(url: str) -> None:
        response = chat(url, key, "Count to twenty.", ignore_eos=True)
        with lock:
            statuses.append(response.status_code)
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "insufficient_quota", response.text

    threads = [threading.Thread(target=send, args=(replica.url,)) for replica in cluster["replicas"] for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, statuses
    prompt = chat(cluster["lb"], cluster["key"], "Count to twenty.", max_tokens=1).json()["usage"]["prompt_tokens"]
    reservation = prompt + MAX_TOKENS
    billed = wait_until(lambda: (rows := httpx.get(cluster["lb"] + "/v1/usage/requests", headers=bearer(key),
                                                    timeout=30).json())["totals"]["requests"] == statuses.count(200)
                        and rows["totals"], what="every admitted request in the ledger", timeout_s=120)
    assert billed["output_tokens"] == statuses.count(200) * MAX_TOKENS  # each ran to its max_tokens
    assert BUDGET_TOKENS - reservation < billed["total_tokens"] <= BUDGET_TOKENS + reservation, (billed, reservation)


def test_a_key_revoked_through_one_replica_is_refused_by_the_other_within_a_second(cluster: dict[str, Any]) -> None:
    first, second = cluster["replicas"]
    key = cluster["doomed_key"]
    for replica in (first, second):  # both know (and cache) the key
        assert chat(replica.url, key, "Hi", max_tokens=1).status_code == 200
    revoked = httpx.delete(f"{first.url}/v1/admin/keys/{cluster['doomed_key_id']}",
                           headers=bearer(cluster["admin_key"]), timeout=30)
    assert revoked.status_code == 200, revoked.text
    start = time.monotonic()
    refused = wait_until(lambda: httpx.get(second.url + "/v1/models", headers=bearer(key), timeout=5).status_code
                         == 401, timeout_s=5, what="the revocation on the other replica")
    assert refused and time.monotonic() - start < 1.0
    assert chat(first.url, key, "Hi", max_tokens=1).status_code == 401


def test_killing_a_sessions_replica_moves_its_next_turn(cluster: dict[str, Any]) -> None:
    lb, key, replicas = cluster["lb"], cluster["key"], cluster["replicas"]
    session_id = httpx.post(lb + "/v1/sessions", json={"model": MODEL}, headers=bearer(key)).headers["x-session-id"]
    for turn in ("My name is Ada.", "I live in Paris."):
        assert chat(lb, key, turn, headers={"x-session-id": session_id}).status_code == 200
    record = httpx.get(f"{lb}/v1/sessions/{session_id}", headers=bearer(key)).json()
    home = next(r for r in replicas if r.name == record["replica_id"])
    survivor = next(r for r in replicas if r is not home)
    moved_before = moved_turns(survivor.url)
    home.kill()  # SIGKILL: no drain, no shutdown hooks

    answer = chat(lb, key, "What is my name?", headers={"x-session-id": session_id})
    assert answer.status_code == 200, answer.text
    record = httpx.get(f"{lb}/v1/sessions/{session_id}", headers=bearer(key)).json()
    assert record["replica_id"] == survivor.name and record["num_turns"] == 3
    assert moved_turns(survivor.url) == moved_before + 1
    # correct: what the whole conversation sent at once gives (the survivor prefilled it all again)
    whole = chat(survivor.url, key, record["messages"][:-1])
    assert whole.json()["choices"][0]["message"]["content"] == answer.json()["choices"][0]["message"]["content"]
    assert answer.json()["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]
    # billed once: the dead replica's journal is taken over by the survivor; every turn is one ledger row
    rows = wait_until(lambda: (page := httpx.get(lb + "/v1/usage/requests", headers=bearer(key), timeout=30,
                                                 params={"session_id": session_id}).json()["data"]) and
                      len(page) == 3 and page, what="the session's three turns in the ledger", timeout_s=120)
    assert len({row["request_id"] for row in rows}) == 3
