"""Helpers shared by the engine tests (imported as a plain module: tests/ has no packages)."""

from __future__ import annotations

import json
from typing import Any

from loraplex.engine.config import ModelConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, RequestOutput, SamplingParams

TINY_COMMON = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    # A wide init gives peaked logits, so greedy argmax is never a float-noise tie.
    "initializer_range": 0.2,
}


def tiny_hf_config(family: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama":  # untied, llama3 rope scaling
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}
        return LlamaConfig(**TINY_COMMON, rope_parameters=rope, tie_word_embeddings=False)
    if family == "mistral":  # untied, explicit head_dim
        return MistralConfig(**TINY_COMMON, sliding_window=None, head_dim=16)
    if family == "qwen2":  # qkv bias, tied, linear rope scaling
        rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
        return Qwen2Config(**TINY_COMMON, rope_parameters=rope, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norm, head_dim != hidden/heads
        return Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=True)
    raise ValueError(family)


def tiny_random_config(**overrides: Any) -> ModelConfig:
    """A ModelConfig for a tiny random Llama (logic tests; nothing to compare against)."""
    raw = {"model_type": "llama", **TINY_COMMON, "vocab_size": 49152, "eos_token_id": 2} | overrides
    return ModelConfig.from_hf_dict(json.loads(json.dumps(raw)))


def run_to_completion(engine: LLMEngine, requests: list[EngineRequest], max_steps: int = 100_000
                      ) -> dict[str, list[RequestOutput]]:
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs[out.request_id].append(out)
    raise AssertionError("engine did not finish")


def output_tokens(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for out in outputs for c in out.choices if c.index == index for t in c.token_ids]


def output_text(outputs: list[RequestOutput], index: int = 0) -> str:
    return "".join(c.text for out in outputs for c in out.choices if c.index == index)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def padded_blocks(block_table: list[int], length: int) -> list[int]:
    """The first `length` block ids, padded with block 0 (masked out), as the input batch pads them."""
    head = block_table[:length]
    return head + [0] * (length - len(head))
