"""Servers, tenants, input files and waits shared by the Batch API tests (a plain module: never conftest).

A `BatchServer` is `loraplex serve` in a subprocess (tests/server_process.py)
on a fresh SQLite database (or the PostgreSQL one given) seeded with tenants
`acme`, `globex` and `initech` (keys with scopes inference + usage) and an
operator tenant's admin key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from loraplex.platform.auth import store
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.db import migrate
from loraplex.platform.db.session import make_db_engine, make_session_factory
from server_process import ServerProcess, server_env
from waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
TENANTS = ("acme", "globex", "initech")
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class BatchServer:
    process: ServerProcess
    database_url: str
    keys: dict[str, str] = field(default_factory=dict)        # tenant name (or "admin") -> API key
    key_ids: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.process.url

    def client(self, tenant: str = "acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.keys[tenant], max_retries=0, timeout=300)

    def http(self, tenant: str = "acme") -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.keys[tenant]}"}, timeout=300)


def seed(database_url: str) -> tuple[dict[str, str], dict[str, str]]:
    migrate.upgrade(database_url)
    engine = make_db_engine(database_url)
    keys, key_ids = {}, {}
    try:
        with make_session_factory(engine)() as db:
            for name in TENANTS:
                tenant = store.create_tenant(db, name=name)
                created = store.create_api_key(db, tenant=tenant, scopes=[Scope.INFERENCE, Scope.USAGE], name=name)
                keys[name], key_ids[name] = created.key, created.record.id
            ops = store.create_tenant(db, name="ops")
            created = store.create_api_key(db, tenant=ops, scopes=[Scope.ADMIN], name="admin")
            keys["admin"], key_ids["admin"] = created.key, created.record.id
    finally:
        engine.dispose()
    return keys, key_ids


def start_batch_server(tmp: Path, model_path: Path, *, database_url: str | None = None, name: str = "batches",
                       **settings: Any) -> BatchServer:
    database_url = database_url or f"sqlite:///{tmp / 'batches.db'}"
    keys, key_ids = seed(database_url)
    values = {"batch_poll_interval_s": 0.2, "max_num_seqs": 8, **settings}
    env = server_env(database_url=database_url, data_dir=tmp, model_path=model_path, **values)
    process = ServerProcess(env, tmp, name=name)
    try:
        process.start(timeout_s=600)
    except BaseException:
        process.terminate()
        raise
    return BatchServer(process=process, database_url=database_url, keys=keys, key_ids=key_ids)


def chat_line(custom_id: str, content: str, *, model: str = MODEL, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "system", "content": "Answer in one short line."},
                                                   {"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


def completion_line(custom_id: str, prompt: str, *, max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def upload(client: openai.OpenAI, lines: list[Any], name: str = "input.jsonl") -> Any:
    return client.files.create(file=(name, jsonl(lines)), purpose="batch")


def wait_batch(client: openai.OpenAI, batch_id: str, *, statuses: tuple[str, ...] = TERMINAL,
               timeout_s: float = 600) -> Any:
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
                      timeout_s=timeout_s, interval_s=0.2,
                      what=lambda: f"batch {batch_id} in {statuses}: {client.batches.retrieve(batch_id)}")


def result_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def ledger_rows(server: BatchServer, tenant: str, batch_id: str) -> list[dict[str, Any]]:
    """The tenant's request log rows of one batch (its request ids start with the batch id)."""
    with server.http(tenant) as http:
        rows = http.get("/v1/usage/requests", params={"limit": 1000}).json()["data"]
    return [row for row in rows if row["request_id"].startswith(batch_id + "-")]
