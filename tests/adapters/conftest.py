"""Shared fixtures for the adapters tests: tiny specs, random and trained PEFT adapters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# tests/fixtures holds plain scripts (no package); make them importable by name.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from loraplex.adapters.base_model import BaseModelSpec
from random_adapters import tiny_spec


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def spec() -> BaseModelSpec:
    return tiny_spec()


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    from loraplex.engine.model.default_model import ensure_default_model

    return ensure_default_model(Path(__file__).resolve().parents[2] / "data" / "models")


@pytest.fixture(scope="session")
def smollm_spec(smollm_dir: Path) -> BaseModelSpec:
    return BaseModelSpec.from_model_dir(smollm_dir)


@pytest.fixture(scope="session")
def trained_adapters(smollm_dir: Path) -> dict[str, Path]:
    from train_adapters import ensure_trained_adapters

    return ensure_trained_adapters(smollm_dir)
