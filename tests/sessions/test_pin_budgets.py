"""Per-tenant and global budgets for pinned session KV, on a real (tiny random) engine.

Past a tenant's budget its own least recently used sessions are offloaded or
dropped, never another tenant's; past the global budget the least recently used
of anyone's go. An evicted session's next turn answers exactly as a stateless
request (greedy), and every block comes back once the sessions are released.
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
from loraplex.platform.settings import Settings
from loraplex.platform.wiring import engine_config
from transformers import AutoTokenizer

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "data" / "models" / "SmolLM2-135M-Instruct"
TINY = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "initializer_range": 0.2, "eos_token_id": 2,
}
PROMPT_LEN, ANSWER_LEN, FOLLOW_UP_LEN = 40, 8, 10  # a first turn pins 2 full blocks of 16


@pytest.fixture(scope="module")
def make_engine():
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = ModelConfig.from_hf_dict(json.loads(json.dumps(TINY)))

    def make(**budgets) -> LLMEngine:
        engine_config = EngineConfig(num_blocks=64, max_model_len=512, **budgets)
        return LLMEngine.from_random(config, engine_config, tokenizer, seed=0)

    return make


def turn(engine: LLMEngine, request_id: str, prompt: list[int], tenant: str, session: str | None) -> list[int]:
    sampling = SamplingParams(max_tokens=ANSWER_LEN, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(request_id, prompt, sampling, tenant_id=tenant, session_id=session))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += [t for choice in out.choices for t in choice.token_ids]
    return tokens


def first_turns(engine: LLMEngine, sessions: list[tuple[str, str]]) -> dict[str, list[int]]:
    """Run each (tenant, key) session's first turn in order; returns each one's second-turn prompt."""
    rng = random.Random(7)
    nexts = {}
    for tenant, key in sessions:
        prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)]
        answer = turn(engine, f"{key}-t1", prompt, tenant, key)
        nexts[key] = prompt + answer + [rng.randrange(100, 40000) for _ in range(FOLLOW_UP_LEN)]
    return nexts


def assert_all_blocks_return(engine: LLMEngine, keys: list[str]) -> None:
    for key in keys:
        engine.release_session(key)
    stats = engine.stats()
    assert stats["num_blocks_pinned"] == 0 and stats["num_blocks_pinned_host"] == 0
    assert stats["pinned_blocks_by_tenant"] == {}
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_tenant_budget_evicts_only_that_tenants_oldest_sessions(make_engine):
    reference = make_engine()
    engine = make_engine(max_pinned_blocks_per_tenant=4)  # two first turns per tenant
    order = [("B", "b0"), ("A", "a0"), ("A", "a1"), ("B", "b1"), ("A", "a2")]
    nexts = first_turns(engine, order)
    states = {key: engine.session_state(key) for _, key in order}
    assert states == {"b0": "pinned", "a0": "dropped", "a1": "pinned", "b1": "pinned", "a2": "pinned"}
    assert engine.stats()["pinned_blocks_by_tenant"] == {"A": 4, "B": 4}
    answer = turn(engine, "a0-t2", nexts["a0"], "A", "a0")
    assert answer == turn(reference, "ref-a0", nexts["a0"], "A", None)
    # a0's second turn pins 4 blocks: all of A's budget, so A's other sessions go; B's stay.
    assert [engine.session_state(k) for k in ("a0", "a1", "a2", "b0", "b1")] == ["pinned", "dropped", "dropped",
                                                                             "pinned", "pinned"]
    assert engine.stats()["pinned_blocks_by_tenant"] == {"A": 4, "B": 4}
    assert_all_blocks_return(engine, [key for _, key in order])


def test_global_budget_offloads_least_recently_used_across_tenants(make_engine):
    reference = make_engine()
    engine = make_engine(max_pinned_blocks=4, num_host_blocks=64)
    order = [("B", "b0"), ("A", "a0"), ("A", "a1")]
    nexts = first_turns(engine, order)
    assert [engine.session_state(k) for k in ("b0", "a0", "a1")] == ["offloaded", "pinned", "pinned"]
    assert engine.stats()["pinned_blocks_by_tenant"] == {"A": 4}  # B's older session made room, not A's
    # Restored (offloading a0, the LRU), then re-pinned with 4 blocks (offloading a1).
    answer = turn(engine, "b0-t2", nexts["b0"], "B", "b0")
    assert answer == turn(reference, "ref-b0", nexts["b0"], "B", None)
    stats = engine.stats()
    assert stats["num_session_restores"] == 1
    assert stats["pinned_blocks_by_tenant"] == {"B": 4} and stats["num_blocks_pinned"] == 4
    assert [engine.session_state(k) for k in ("a0", "a1")] == ["offloaded", "offloaded"]
    assert_all_blocks_return(engine, ["b0", "a0", "a1"])


def test_a_session_larger_than_the_budget_is_not_pinned_and_re_prefills_exactly(make_engine):
    reference = make_engine()
    engine = make_engine(max_pinned_blocks_per_tenant=3)
    nexts = first_turns(engine, [("A", "big")])
    assert engine.session_state("big") == "pinned"
    answer = turn(engine, "big-t2", nexts["big"], "A", "big")  # 4 blocks now: more than the budget
    assert answer == turn(reference, "ref-big", nexts["big"], "A", None)
    assert engine.session_state("big") == "dropped"
    assert engine.stats()["num_pins_over_budget"] == 1 and engine.stats()["num_blocks_pinned"] == 0


def test_settings_reach_the_engine_config(monkeypatch):
    monkeypatch.setenv("LORAPLEX_MAX_PINNED_BLOCKS", "100")
    monkeypatch.setenv("LORAPLEX_MAX_PINNED_BLOCKS_PER_TENANT", "20")
    config = engine_config(Settings(device="cpu", dtype="float32"))
    assert (config.max_pinned_blocks, config.max_pinned_blocks_per_tenant) == (100, 20)
    monkeypatch.delenv("LORAPLEX_MAX_PINNED_BLOCKS")
    assert engine_config(Settings(device="cpu", dtype="float32")).max_pinned_blocks is None
