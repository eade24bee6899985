"""The kernels' LoRA metadata is built once per adapter mix (engine/lora/step.py `cached_metadata`)."""

from __future__ import annotations

import torch
from loraplex.engine.config import ModelConfig
from loraplex.engine.kernels.lora_metadata import build_lora_metadata
from loraplex.engine.lora import step
from loraplex.engine.lora.slot_pool import LoRASlotPool
from loraplex.engine.model.loader import random_model

CONFIG = ModelConfig.from_hf_dict({
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
})


def make_pool() -> LoRASlotPool:
    model = random_model(CONFIG, 128, seed=0, dtype=torch.float32, device="cpu")
    return LoRASlotPool(model, max_loras=4, max_lora_rank=8, dtype=torch.float32, device="cpu")


def test_a_repeated_mix_reuses_its_metadata_and_a_new_mix_gets_its_own() -> None:
    pool = make_pool()
    mix = [0, 2, -1, 0, 3, -1, -1, 1]
    first = step.cached_metadata(mix, pool)
    assert step.cached_metadata(list(mix), pool) is first  # same content: the same object, no rebuild
    other = step.cached_metadata([1, 1, -1, -1, -1, -1, -1, -1], pool)
    assert other is not first
    fresh = build_lora_metadata(mix, max_loras=4, device="cpu")
    assert torch.equal(first.packed, fresh.packed)


def test_the_cache_is_bounded_and_prefill_sized_batches_are_not_cached() -> None:
    pool = make_pool()
    for i in range(step.METADATA_CACHE_SIZE + 5):
        step.cached_metadata([i % 4, -1, (i // 4) % 4, -1, i % 3], pool)
    assert len(pool.metadata_cache) == step.METADATA_CACHE_SIZE
    long = [0] * (step.METADATA_CACHE_MAX_TOKENS + 1)
    a, b = step.cached_metadata(long, pool), step.cached_metadata(long, pool)
    assert a is not b and torch.equal(a.packed, b.packed)
