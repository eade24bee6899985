"""Pinned session KV under pressure: offloaded to the host tier and restored, or dropped; answers stay exact.

A tiny random Llama on the CPU (the point is block bookkeeping and the copies);
every answer is compared with an engine that never runs short of blocks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, SamplingParams
from transformers import AutoTokenizer

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "data" / "models" / "SmolLM2-135M-Instruct"
TINY = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "initializer_range": 0.2, "eos_token_id": 2,
}
PROMPT_LEN, ANSWER_LEN, FOLLOW_UP_LEN = 40, 8, 10  # a turn pins 2 full blocks of 16 (47 computed tokens)


@pytest.fixture(scope="module")
def make_engine():
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = ModelConfig.from_hf_dict(json.loads(json.dumps(TINY)))

    def make(num_blocks: int, num_host_blocks: int = 0) -> LLMEngine:
        engine_config = EngineConfig(num_blocks=num_blocks, num_host_blocks=num_host_blocks, max_model_len=512)
        return LLMEngine.from_random(config, engine_config, tokenizer, seed=0)

    return make


def turn(engine: LLMEngine, request_id: str, prompt: list[int], session: str | None) -> tuple[list[int], int]:
    """Run one greedy request to the end; (output tokens, cached prompt tokens)."""
    sampling = SamplingParams(max_tokens=ANSWER_LEN, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(request_id, prompt, sampling, session_id=session))
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
            tokens += [t for choice in out.choices for t in choice.token_ids]
    return tokens, cached


def conversations(num: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(num)]


def second_prompts(engine: LLMEngine, firsts: list[list[int]], keys: list[str]) -> list[list[int]]:
    rng = random.Random(6)
    prompts = []
    for index, (prompt, key) in enumerate(zip(firsts, keys, strict=True)):
        answer, _ = turn(engine, f"{key}-t1-{index}", prompt, key)
        prompts.append(prompt + answer + [rng.randrange(100, 40000) for _ in range(FOLLOW_UP_LEN)])
    return prompts


def test_offloaded_sessions_are_restored_from_host_and_answer_exactly(make_engine):
    reference = make_engine(num_blocks=256)
    engine = make_engine(num_blocks=8, num_host_blocks=64)  # room for 2 pinned sessions beside a running one
    keys = [f"s{i}" for i in range(6)]
    nexts = second_prompts(engine, conversations(6), keys)
    stats = engine.stats()
    assert stats["num_session_offloads"] >= 3 and stats["num_blocks_pinned_host"] > 0
    assert engine.session_state("s0") == "offloaded"
    answer, cached = turn(engine, "s0-t2", nexts[0], "s0")
    expected, _ = turn(reference, "ref-s0", nexts[0], None)
    assert answer == expected
    assert cached == PROMPT_LEN + ANSWER_LEN - 1 - (PROMPT_LEN + ANSWER_LEN - 1) % 16  # every pinned block
    assert engine.stats()["num_session_restores"] == 1
    assert engine.host_tier.num_blocks_copied_in > 0, "the device copies were overwritten: bytes came back from host"
    assert engine.session_state("s0") == "pinned"


def test_sessions_past_the_host_budget_are_dropped_and_re_prefill_exactly(make_engine):
    reference = make_engine(num_blocks=256)
    engine = make_engine(num_blocks=8, num_host_blocks=2)  # the host holds one session (2 blocks) at most
    keys = [f"d{i}" for i in range(6)]
    nexts = second_prompts(engine, conversations(6), keys)
    assert engine.stats()["num_session_drops"] >= 2
    assert engine.session_state("d0") == "dropped"
    answer, cached = turn(engine, "d0-t2", nexts[0], "d0")
    expected, _ = turn(reference, "ref-d0", nexts[0], None)
    assert answer == expected
    assert cached < PROMPT_LEN, "its blocks were gone: the turn prefilled again"


def test_release_frees_device_and_host(make_engine):
    engine = make_engine(num_blocks=8, num_host_blocks=64)
    keys = [f"r{i}" for i in range(5)]
    second_prompts(engine, conversations(5), keys)
    offloaded = [k for k in keys if engine.session_state(k) == "offloaded"]
    pinned = [k for k in keys if engine.session_state(k) == "pinned"]
    assert offloaded and pinned
    for key in keys:
        assert engine.release_session(key)
    stats = engine.stats()
    assert stats["num_blocks_pinned"] == 0 and stats["num_blocks_pinned_host"] == 0
    assert all(engine.session_state(k) == "dropped" for k in keys)


def test_no_host_tier_keeps_the_drop_behaviour(make_engine):
    engine = make_engine(num_blocks=8)
    second_prompts(engine, conversations(5), [f"n{i}" for i in range(5)])
    stats = engine.stats()
    assert stats["num_session_offloads"] == 0 and stats["num_session_drops"] >= 1
