"""Rate limits hold across two server processes that share PostgreSQL and Redis."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from e2e_helpers import MODEL, auth
from loraplex.platform.auth import store
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.db import migrate
from loraplex.platform.db.session import make_db_engine, make_session_factory
from server_process import ServerProcess, server_env
from waiting import wait_for_fresh_rate_window

RPM = 3


@pytest.fixture(scope="module")
def shared_key(postgres_url: str) -> str:
    migrate.upgrade(postgres_url)
    engine = make_db_engine(postgres_url)
    with make_session_factory(engine)() as db:
        tenant = store.create_tenant(db, name="ratelimited")
        key = store.create_api_key(db, tenant=tenant, scopes=[Scope.INFERENCE], rpm_limit=RPM).key
    engine.dispose()
    return key


@pytest.fixture(scope="module")
def two_servers(postgres_url: str, redis_url: str, redis_prefix: str, smollm_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    data_dir = tmp_path_factory.mktemp("two-servers")
    # No batch work is sent: each server's idle batch-worker process would cost ~8 CPU-seconds of a 2-core box.
    env = server_env(database_url=postgres_url, data_dir=data_dir, model_path=smollm_path,
                     redis_url=redis_url, redis_key_prefix=redis_prefix, batch_workers_enabled=False)
    with ExitStack() as stack:
        servers = [stack.enter_context(ServerProcess(env, data_dir, name=f"server-{i}")) for i in range(2)]
        for server in servers:
            server.start(wait=False)
        try:
            for server in servers:
                server.wait_healthy()
            yield [server.url for server in servers]
        finally:
            for server in servers:  # captured: shown with the report of a failing test only
                server.print_log()


def test_requests_per_minute_shared_by_two_processes(two_servers: list[str], shared_key: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    wait_for_fresh_rate_window()
    statuses = []
    for i in range(RPM + 2):
        url = two_servers[i % 2]
        response = httpx.post(url + "/v1/completions", json=body, headers=auth(shared_key), timeout=60)
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
    # Each process alone saw at most 2 requests; only the shared count can refuse the 4th and 5th.
    assert statuses == [200] * RPM + [429, 429]
