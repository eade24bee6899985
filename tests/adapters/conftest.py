"""Shared fixtures for the adapters tests: tiny specs, random and trained PEFT adapters."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loraplex.adapters.base_model import BaseModelSpec
from loraplex.adapters.registry import SqlAdapterRegistry
from random_adapters import tiny_spec
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker


@pytest.fixture(scope="session")
def spec() -> BaseModelSpec:
    return tiny_spec()


@pytest.fixture(scope="session")
def smollm_dir(smollm_path: Path) -> Path:
    return smollm_path


@pytest.fixture(scope="session")
def ours(smollm_weights: Any) -> tuple[Any, Any]:
    """(model, ModelConfig): the run's one copy of SmolLM2 (tests/conftest.py); LoRA never changes the model."""
    return smollm_weights.model, smollm_weights.config


@pytest.fixture(scope="session")
def smollm_spec(smollm_dir: Path) -> BaseModelSpec:
    return BaseModelSpec.from_model_dir(smollm_dir)


@pytest.fixture(scope="session")
def trained_adapters(smollm_dir: Path) -> dict[str, Path]:
    from train_adapters import ensure_trained_adapters

    return ensure_trained_adapters(smollm_dir)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database migrated through the whole Alembic chain; dropped afterwards."""
    import psycopg
    from loraplex.platform.db.migrate import upgrade

    name = f"lpx_adapters_{uuid.uuid4().hex[:10]}"
    admin = "postgresql://postgres@127.0.0.1:5432/test"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    upgrade(url)
    yield url
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sql_registry(pg_url: str) -> Iterator[SqlAdapterRegistry]:
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM adapters"))
    yield SqlAdapterRegistry(sessionmaker(engine, expire_on_commit=False))
    engine.dispose()
