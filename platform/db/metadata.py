"""Every domain's table metadata, for Alembic (each domain keeps its own DeclarativeBase)."""

from __future__ import annotations

import importlib
from types import ModuleType

from sqlalchemy import MetaData

DOMAIN_MODEL_MODULES = (
    "loraplex.platform.db.models",
    "loraplex.adapters.models",
    "loraplex.billing.models",
    "loraplex.platform.batches.models",
)


def domain_metadatas() -> list[MetaData]:
    """The metadata of each domain whose models module exists (a domain not written yet is skipped)."""
    metadatas: list[MetaData] = []
    for module_name in DOMAIN_MODEL_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        for metadata in _declarative_metadatas(module):
            if metadata not in metadatas:
                metadatas.append(metadata)
    return metadatas


def _declarative_metadatas(module: ModuleType) -> list[MetaData]:
    found: list[MetaData] = []
    for value in vars(module).values():
        metadata = getattr(value, "metadata", None)
        is_base = isinstance(value, type) and hasattr(value, "registry")
        if is_base and isinstance(metadata, MetaData) and metadata not in found:
            found.append(metadata)
    return found
