"""Fixtures for the grammar tests: the real SmolLM2 tokenizer and one compiler service."""

from __future__ import annotations

from pathlib import Path

import pytest
from grammar_helpers import SMOLLM2_VOCAB
from loraplex.grammar.compiler import GrammarCompilerService
from transformers import AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from loraplex.engine.model.default_model import ensure_default_model

    return ensure_default_model(REPO_ROOT / "data" / "models")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def compiler(tokenizer) -> GrammarCompilerService:
    service = GrammarCompilerService(tokenizer, SMOLLM2_VOCAB)
    yield service
    service.close()
