"""Rate limits hold across two server processes that share PostgreSQL and Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import MODEL, auth
from loraplex.platform.auth import store
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.db import migrate
from loraplex.platform.db.session import make_db_engine, make_session_factory

REPO_ROOT = Path(__file__).resolve().parents[2]
RPM = 3


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not become healthy")


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
    env = {
        **os.environ,
        "LORAPLEX_DATABASE_URL": postgres_url,
        "LORAPLEX_REDIS_URL": redis_url,
        "LORAPLEX_REDIS_KEY_PREFIX": redis_prefix,
        "LORAPLEX_MODEL_PATH": str(smollm_path),
        "LORAPLEX_DATA_DIR": str(tmp_path_factory.mktemp("two-servers")),
        "LORAPLEX_KV_CACHE_MEMORY_MB": "32",
        "LORAPLEX_DEVICE": "cpu",
        "LORAPLEX_LOG_LEVEL": "warning",
    }
    processes: list[subprocess.Popen[Any]] = []
    urls = []
    try:
        for _ in range(2):
            port = _free_port()
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "loraplex.platform.cli.main", "serve", "--port", str(port)],
                cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
            urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(urls, processes, strict=True):
            _wait_healthy(url, process)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait_for_fresh_window(margin_s: float = 15) -> None:
    """Counts live in one-minute windows; start far enough from a boundary that one window holds the test."""
    into_minute = time.time() % 60
    if into_minute > 60 - margin_s:
        time.sleep(60 - into_minute + 0.5)


def test_requests_per_minute_shared_by_two_processes(two_servers: list[str], shared_key: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    _wait_for_fresh_window()
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
