"""By default one tenant's sessions (and stored responses) may pin only a share of the device pool: past it, that
tenant's own oldest pins go, never another tenant's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, SamplingParams
from loraplex.platform.settings import Settings
from loraplex.platform.wiring import engine_config
from transformers import AutoTokenizer

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "data" / "models" / "SmolLM2-135M-Instruct"
TINY = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "initializer_range": 0.2, "eos_token_id": 2,
}


def _first_turn(engine: LLMEngine, tenant: str, key: str, rng: random.Random) -> None:
    """A 40-token prompt and 8 tokens of answer: 2 full blocks of 16 pinned under `key`."""
    prompt = [rng.randrange(100, 40000) for _ in range(40)]
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(f"{key}-t1", prompt, sampling, tenant_id=tenant, session_id=key))
    while engine.has_unfinished_requests():
        engine.step()


def test_the_default_share_reaches_the_engine_config() -> None:
    settings = Settings(device="cpu", dtype="float32")
    assert settings.max_pinned_blocks_per_tenant is None
    assert engine_config(settings).max_pinned_blocks_per_tenant == 0.25
    unlimited = Settings(device="cpu", dtype="float32", pinned_kv_share_per_tenant=1)
    assert engine_config(unlimited).max_pinned_blocks_per_tenant is None
    explicit = Settings(device="cpu", dtype="float32", max_pinned_blocks_per_tenant=20)
    assert engine_config(explicit).max_pinned_blocks_per_tenant == 20


def test_a_share_of_the_pool_caps_each_tenants_pins() -> None:
    torch.set_num_threads(1)
    config = EngineConfig(num_blocks=64, max_model_len=512, max_pinned_blocks_per_tenant=4 / 64)  # 4 per tenant
    engine = LLMEngine.from_random(ModelConfig.from_hf_dict(json.loads(json.dumps(TINY))), config,
                                   AutoTokenizer.from_pretrained(TOKENIZER_DIR), seed=0)
    assert engine.block_manager.max_pinned_blocks_per_tenant == 4
    order = [("B", "b0"), ("A", "a0"), ("A", "a1"), ("B", "b1"), ("A", "a2")]
    rng = random.Random(7)
    for tenant, key in order:
        _first_turn(engine, tenant, key, rng)
    states = {key: engine.session_state(key) for _, key in order}
    assert states == {"b0": "pinned", "a0": "dropped", "a1": "pinned", "b1": "pinned", "a2": "pinned"}
    assert engine.stats()["pinned_blocks_by_tenant"] == {"A": 4, "B": 4}
