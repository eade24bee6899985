"""Engine test fixtures: the run's one SmolLM2 load, tiny random families.

Tests run with one intra-op thread: the CI box has two cores shared by
many jobs, where a second spinning OpenMP thread costs far more than it gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from enginecore_helpers import tiny_hf_config
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.model.llama import LlamaForCausalLM
from loraplex.engine.model.loader import load_model

torch.set_num_threads(1)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count from one to ten.",
    "Explain gravity to a child in two sentences.",
    "Give me three names for a cat.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "List the planets of the solar system.",
]


@dataclass
class LoadedModel:
    path: Path
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any

    def engine(self, **overrides: Any) -> LLMEngine:
        settings = {"kv_cache_bytes": 32 << 20, "max_model_len": 2048} | overrides
        return LLMEngine(self.model, self.config, EngineConfig(**settings), self.tokenizer)


@pytest.fixture(scope="session")
def smol(smollm_path: Path, smollm_weights: Any) -> LoadedModel:
    """The run's one copy of SmolLM2 (tests/conftest.py), with a tokenizer of the engine tests' own."""
    from transformers import AutoTokenizer

    return LoadedModel(smollm_path, smollm_weights.model, smollm_weights.config,
                       AutoTokenizer.from_pretrained(smollm_path))


@pytest.fixture(scope="session")
def chat_prompt_ids(smol: LoadedModel) -> list[list[int]]:
    return [
        list(smol.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 return_dict=False))
        for p in CHAT_PROMPTS
    ]


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory, smol: LoadedModel) -> Callable[[str], tuple[Any, LoadedModel]]:
    """family -> (HF model, our model loaded from the HF model's saved folder)."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[Any, LoadedModel]] = {}

    def build(family: str) -> tuple[Any, LoadedModel]:
        if family not in cache:
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(tiny_hf_config(family)).eval()
            if hf.model.layers[0].self_attn.q_proj.bias is not None:
                with torch.no_grad():  # HF inits biases to zero; make them matter
                    for layer in hf.model.layers:
                        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                            proj.bias.normal_(0.0, 0.2)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            config = ModelConfig.from_pretrained(path)
            ours = LoadedModel(path, load_model(path, max_model_len=512), config, smol.tokenizer)
            cache[family] = (hf, ours)
        return cache[family]

    return build


