"""Fixtures shared by every test folder.

- `postgres_url`: a freshly created PostgreSQL database for this test run (dropped at the end).
- `redis_url` + `redis_prefix`: the shared Redis with a key prefix unique to this run (keys deleted after).
- `smollm_path` / `smollm_weights` / `smollm_engine`: the bundled SmolLM2-135M-Instruct (converted once into
  data/models), its weights loaded once for every in-process engine, and one session-wide AsyncEngine over them.
- `start_server`: a real uvicorn server on a free port (a thread of this process, sharing an engine; with
  `engine_core_address=` it talks to an engine-core process instead, as `loraplex serve` does).
- `engine_core`: one engine-core process for the session (the e2e suite's server runs on it).
- `api_server`: one such server per test module, with two tenants and keys of every scope; `openai_client`
  calls it.

Tests marked `gpu` are skipped when CUDA is absent (run them on a machine with a GPU).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from heap import HeapKeeper
from local_serving import free_port, serve_in_thread
from rss_report import register as register_rss_report

# Triton picks compile or interpret when a kernel is decorated, i.e. when its module is
# first imported, and other test folders import engine code (with kernels) long before
# tests/engine/kernels/conftest.py loads: switch the interpreter on here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The in-process engines compute on one thread: on the two cores the suite shares with its servers and
    # clients, a second spinning OpenMP thread costs far more than it gives (tests/engine did so already).
    torch.set_num_threads(1)
    # And so do the processes the tests start (benchmarks' --quick runs, `make serve`, the README's commands)
    # where they leave torch its default: a quick benchmark's server took 308 s instead of 97 with two threads
    # while the other test lane ran. A setting that names threads (LORAPLEX_ENGINE_CPU_THREADS) still wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO_ROOT / "data" / "models"
PG_ADMIN_DSN = os.environ.get("LORAPLEX_TEST_PG_ADMIN_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres")
PG_URL_TEMPLATE = os.environ.get("LORAPLEX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/{name}")
REDIS_TEST_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def pytest_configure(config: pytest.Config) -> None:
    register_rss_report(config)


HEAP = HeapKeeper()


def pytest_collection_finish(session: pytest.Session) -> None:
    HEAP.freeze_collected()


def pytest_unconfigure(config: pytest.Config) -> None:
    HEAP.unfreeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Give freed memory back: after a module (its fixtures are gone), or a test that left much behind."""
    yield
    HEAP.after_test(last_of_module=nextitem is None or nextitem.path != item.path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run them on a machine with one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- databases --------------------------------------------------------------------------------

@contextmanager
def fresh_postgres_database(prefix: str = "loraplex_test") -> Iterator[str]:
    """Create an empty database on the test server; drop it (forcibly) afterwards."""
    import psycopg

    name = f"{prefix}_{secrets.token_hex(5)}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_URL_TEMPLATE.format(name=name)
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def new_postgres_database() -> Callable[..., Any]:
    """`with new_postgres_database("prefix") as url:` another throwaway database."""
    return fresh_postgres_database


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    client = redis.Redis.from_url(REDIS_TEST_URL)
    client.ping()
    client.close()
    return REDIS_TEST_URL


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[Any]:
    """A client of the shared test Redis, for tests that talk to it directly."""
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def key_prefix(request: pytest.FixtureRequest, redis_client: Any) -> Iterator[str]:
    """A key prefix of this test alone (named after its folder); its keys are deleted after it."""
    prefix = f"lpxtest:{request.path.parent.name}:{secrets.token_hex(4)}:"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}*"))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture(scope="session")
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test run uses; every key under it is deleted at the end."""
    import redis

    prefix = f"lpxtest:{secrets.token_hex(4)}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


# ---- model and engine ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from loraplex.engine.model.default_model import ensure_default_model

    return ensure_default_model(MODELS_DIR)


TEST_ENGINE_CONFIG = {
    "kv_cache_bytes": 128 * 1024 * 1024,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 512,
    "max_model_len": 2048,
    "dtype": "float32",
    "device": "cpu",
}


@dataclass(frozen=True)
class SmolWeights:
    model: Any  # LlamaForCausalLM
    config: Any  # ModelConfig


@pytest.fixture(scope="session")
def smollm_weights(smollm_path: Path) -> SmolWeights:
    """SmolLM2 loaded once (float32, CPU, 2048 positions): every in-process engine of the run shares these
    weights, as no engine changes its model (adapters and KV live beside it), instead of a copy per engine."""
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.model.loader import load_model

    return SmolWeights(load_model(smollm_path, TEST_ENGINE_CONFIG["max_model_len"]),
                       ModelConfig.from_pretrained(smollm_path))


@pytest.fixture(scope="session")
def smollm_engine(smollm_weights: SmolWeights, smollm_path: Path) -> Iterator[Any]:
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from transformers import AutoTokenizer

    # a tokenizer of its own: the engine thread must not share one with tests running beside it
    engine = AsyncEngine(LLMEngine(smollm_weights.model, smollm_weights.config, EngineConfig(**TEST_ENGINE_CONFIG),
                                   AutoTokenizer.from_pretrained(smollm_path), detokenize=False))
    yield engine
    engine.shutdown()


# ---- servers ------------------------------------------------------------------------------------


@dataclass
class RunningServer:
    base_url: str
    app: Any
    settings: Any
    keys: dict[str, str] = field(default_factory=dict)       # label -> full API key
    key_ids: dict[str, str] = field(default_factory=dict)    # label -> key id
    tenants: dict[str, str] = field(default_factory=dict)    # name -> tenant id

    @property
    def services(self) -> Any:
        return self.app.state.services

    def client(self, key_label: str = "all", **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.keys[key_label], max_retries=0, **kwargs)


def seed_tenants(database_url: str) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Tenants `acme` and `globex`; acme gets a key per scope, one with all, and a revoked one."""
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.db.session import make_db_engine, make_session_factory

    engine = make_db_engine(database_url)
    keys: dict[str, str] = {}
    key_ids: dict[str, str] = {}
    with make_session_factory(engine)() as db:
        acme = store.create_tenant(db, name="acme")
        globex = store.create_tenant(db, name="globex")
        wanted = {scope.value: (acme, [scope]) for scope in Scope}
        wanted["all"] = (acme, list(Scope))
        wanted["revoked"] = (acme, list(Scope))
        wanted["globex"] = (globex, [Scope.INFERENCE, Scope.ADAPTERS, Scope.USAGE])
        for label, (tenant, scopes) in wanted.items():
            created = store.create_api_key(db, tenant=tenant, scopes=scopes, name=label)
            keys[label], key_ids[label] = created.key, created.record.id
        store.revoke_api_key(db, key_id=key_ids["revoked"])
        tenants = {"acme": acme.id, "globex": globex.id}
    engine.dispose()
    return keys, key_ids, tenants


ServerFactory = Callable[..., Any]
# Each app builds its own LoRA slot pool on the shared engine (about 78 MB a slot for SmolLM2 at rank 64, float32):
# four slots hold every trained adapter at once at less than half the default's eight.
TEST_SERVER_SETTINGS = {"max_loras": 4}


@pytest.fixture(scope="session")
def start_server(
    request: pytest.FixtureRequest, smollm_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerFactory]:
    """`with start_server(**settings_overrides) as server:` a fresh app (own SQLite DB) on the shared engine.

    `send_buffer_bytes=` fixes each connection's kernel send buffer (see `serve_in_thread`).

    The shared engine is loaded the first time a server needs it: one given `engine_core_address=` does not."""
    from loraplex.platform.app import create_app
    from loraplex.platform.db import migrate
    from loraplex.platform.settings import Settings

    @contextmanager
    def start(*, send_buffer_bytes: int | None = None, **overrides: Any) -> Iterator[RunningServer]:
        data_dir = tmp_path_factory.mktemp("server")
        values = {"data_dir": data_dir, "model_path": smollm_path, "migrate_on_start": True, **TEST_SERVER_SETTINGS,
                  **overrides}
        settings = Settings(**values)
        migrate.upgrade(settings.resolved_database_url)
        keys, key_ids, tenants = seed_tenants(settings.resolved_database_url)
        # An app given an engine-core address connects to that process; otherwise it shares the in-process engine.
        engine = None if settings.engine_core_address else request.getfixturevalue("smollm_engine")
        app = create_app(settings, engine=engine)
        with serve_in_thread(app, free_port(), send_buffer_bytes=send_buffer_bytes,
                             unread_timeout_s=settings.stream_send_timeout_s) as base_url:
            yield RunningServer(base_url=base_url, app=app, settings=settings, keys=keys, key_ids=key_ids, tenants=tenants)

    yield start


@pytest.fixture(scope="session")
def engine_core(smollm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The engine in its own process (EngineCoreProcess), on the settings of `smollm_engine`."""
    from loraplex.platform.db import migrate
    from loraplex.platform.engine_process import start_engine_core
    from loraplex.platform.settings import Settings

    config = {k: v for k, v in TEST_ENGINE_CONFIG.items() if k != "kv_cache_bytes"}
    settings = Settings(data_dir=tmp_path_factory.mktemp("engine-core"), model_path=smollm_path, engine_cpu_threads=1,
                        kv_cache_memory_mb=TEST_ENGINE_CONFIG["kv_cache_bytes"] // 2**20, **config)
    migrate.upgrade(settings.resolved_database_url)  # the core reads adapters from this database
    core = start_engine_core(settings)
    try:
        core.wait_ready(600)
        yield core
    finally:
        core.stop()


@pytest.fixture(scope="module")
def api_server(start_server: ServerFactory) -> Iterator[RunningServer]:
    """Per module, so its LoRA pool and caches go when the module ends instead of staying for the whole run."""
    with start_server() as server:
        yield server


@pytest.fixture
def openai_client(api_server: RunningServer) -> Any:
    return api_server.client("all")
