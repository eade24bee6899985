"""Helpers of the scale-out tests: polling with a deadline, tenants and keys in a database, adapter uploads,
and the ZeroMQ subscriber standing in for llm-d's endpoint picker."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import waiting
import zmq
from local_serving import free_port

MODEL = "SmolLM2-135M-Instruct"


# tests/waiting.py's wait_until with these tests' defaults: a minute, and an HTTP error means "not yet"
wait_until = partial(waiting.wait_until, timeout_s=60.0, interval_s=0.05, what="it", ignoring=(httpx.HTTPError,))


def create_tenant(database_url: str, name: str, *, scopes: tuple[str, ...] = ("inference", "adapters", "usage"),
                  rpm: int | None = None) -> tuple[str, str, str]:
    """(tenant id, API key, key id) of a new tenant with one key."""
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.db.session import make_db_engine, make_session_factory

    engine = make_db_engine(database_url)
    with make_session_factory(engine)() as db:
        tenant = store.create_tenant(db, name=name)
        created = store.create_api_key(db, tenant=tenant, scopes=[Scope(s) for s in scopes], rpm_limit=rpm)
        result = tenant.id, created.key, created.record.id
    engine.dispose()
    return result


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def write_adapter(folder: Path, model_path: Path, seed: int) -> list[tuple[str, bytes]]:
    """A random PEFT adapter shaped for the served model, as the multipart files of an upload."""
    from loraplex.adapters.base_model import BaseModelSpec
    from loraplex.adapters.random_adapters import write_random_adapter

    write_random_adapter(folder, BaseModelSpec.from_model_dir(model_path), r=4, targets=("q_proj", "v_proj"),
                         seed=seed)
    return [(n, (folder / n).read_bytes()) for n in ("adapter_config.json", "adapter_model.safetensors")]


def upload_adapter(base_url: str, key: str, name: str, files: list[tuple[str, bytes]],
                   timeout_s: float = 180) -> dict[str, Any]:
    """Upload, then wait for validation; the adapter's record once it is no longer `validating`."""
    parts = [("file", (filename, data, "application/octet-stream")) for filename, data in files]
    created = httpx.post(f"{base_url}/v1/adapters", data={"name": name}, files=parts, headers=bearer(key), timeout=120)
    assert created.status_code == 202, created.text
    adapter_url = f"{base_url}/v1/adapters/{created.json()['id']}"
    return wait_until(lambda: (body := httpx.get(adapter_url, headers=bearer(key), timeout=30).json())["status"]
                      != "validating" and body, timeout_s=timeout_s, what=f"validation of {name}")


class EventSubscriber:
    """A ZeroMQ SUB socket bound where servers send KV-cache events (as llm-d's picker binds tcp://*:5557), read
    all the time by a thread of its own, as a real subscriber does: a SUB socket sends its subscription to a
    publisher that connects only while it is being read, and the publisher drops what it sends before that."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self._socket.bind(self.endpoint)
        self._batches: list[tuple[str, int, list]] = []  # (topic, sequence number, [ts, events, rank])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="kv-event-subscriber", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                topic, seq, payload = self._socket.recv_multipart()
                batch = (topic.decode(), int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload))
                with self._lock:
                    self._batches.append(batch)

    def drain(self) -> list[tuple[str, int, list]]:
        """Every batch received so far."""
        with self._lock:
            return list(self._batches)

    def events(self, topic: str | None = None) -> list[list]:
        return [e for t, _, batch in self.drain() if topic is None or t == topic for e in batch[1]]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()
