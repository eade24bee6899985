"""Fixtures for billing tests: a fresh real database per test (SQLite file and PostgreSQL), real Redis.

PostgreSQL tests each get their own throwaway database on the shared server;
Redis tests get a unique key prefix and delete their keys afterwards. Tests that
stop the database get `private_postgres`: a server of their own (never the shared one).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg
import pytest
from loraplex.billing.events import UsageEvent, UsageStatus
from loraplex.billing.models import BillingBase
from private_postgres import PrivatePostgres
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
# Nothing listens on port 1: connections are refused at once, like a stopped database.
REFUSING_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere?connect_timeout=2"


def _pg_available() -> bool:
    try:
        psycopg.connect(PG_ADMIN_DSN, connect_timeout=2).close()
        return True
    except psycopg.OperationalError:
        return False


@pytest.fixture
def pg_url() -> Iterator[str]:
    if not _pg_available():
        pytest.fail("PostgreSQL at 127.0.0.1:5432 is required for billing tests")
    name = f"lpx_billing_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield PG_URL.format(name=name)
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'billing.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_wal)
        return engine
    return create_engine(url, pool_pre_ping=True)


def _sqlite_wal(dbapi_connection, _record) -> None:
    dbapi_connection.execute("PRAGMA journal_mode=WAL")


@pytest.fixture
def db_engine(db_url: str) -> Iterator[Engine]:
    engine = make_engine(db_url)
    BillingBase.metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def session_factory(db_engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(db_engine, expire_on_commit=False)


@pytest.fixture
def pg_session_factory(pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(pg_url)
    BillingBase.metadata.create_all(engine)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server for this test alone, started; the test may `.stop()` and `.start()` it."""
    server = PrivatePostgres.create()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def refusing_engine() -> Iterator[Engine]:
    engine = create_engine(REFUSING_PG_URL, pool_pre_ping=True)
    yield engine
    engine.dispose()


@pytest.fixture
def make_event():
    return build_event


def build_event(request_id: str | None = None, **overrides) -> UsageEvent:
    values = {
        "request_id": request_id or f"req_{uuid.uuid4().hex}",
        "tenant_id": "ten_a",
        "model": "smollm2",
        "status": UsageStatus.COMPLETED,
        "created_at": datetime.now(UTC),
        "api_key_id": "key_a1",
        "input_tokens": 100,
        "cached_input_tokens": 20,
        "output_tokens": 50,
        "thinking_tokens": 10,
        "ttft_ms": 12.5,
        "duration_ms": 80.0,
    }
    values.update(overrides)
    return UsageEvent(**values)
