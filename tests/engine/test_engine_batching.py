"""Continuous batching, chunked prefill, prefix cache, preemption and forks give the same tokens."""

from __future__ import annotations

import pytest
import torch
from enginecore_helpers import greedy, output_tokens, run_to_completion
from loraplex.engine.protocol import EngineRequest


@pytest.fixture(scope="module")
def tiny(tiny_family):
    return tiny_family("llama")[1]


def random_prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


def alone(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    engine = loaded.engine(kv_cache_bytes=4 << 20, max_model_len=512)
    out = run_to_completion(engine, [EngineRequest("solo", prompt, greedy(max_tokens, ignore_eos=True))])
    return output_tokens(out["solo"])


def test_sixteen_concurrent_requests_match_running_alone(tiny):
    prompts = random_prompts(16, 3, 200)
    max_tokens = [8 + (i * 5) % 17 for i in range(16)]
    # A small step budget forces chunked prefill mixed with decodes of other requests.
    engine = tiny.engine(kv_cache_bytes=8 << 20, max_model_len=512, max_num_batched_tokens=96)
    requests = [EngineRequest(f"c{i}", p, greedy(m, ignore_eos=True))
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
    outputs = run_to_completion(engine, requests)
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert output_tokens(outputs[f"c{i}"]) == alone(tiny, prompt, m), f"request {i}"
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_prefix_cache_reuses_a_200_token_prefix_and_output_is_unchanged(smol):
    prefix = smol.tokenizer.encode("The history of the printing press. " * 30)[:200]
    assert len(prefix) == 200
    question = smol.tokenizer.encode(" In one sentence, who invented it?")
    engine = smol.engine()
    first = run_to_completion(engine, [EngineRequest("a", [*prefix, 11, 12], greedy(4))])["a"]
    assert first[-1].num_cached_tokens == 0
    second = run_to_completion(engine, [EngineRequest("b", prefix + question, greedy(12))])["b"]
    assert second[-1].num_cached_tokens == 192  # 12 whole blocks of 16 out of the 200-token prefix
    assert engine.block_manager.num_prefix_hits == 192
    fresh = smol.engine(enable_prefix_caching=False)
    reference = run_to_completion(fresh, [EngineRequest("c", prefix + question, greedy(12))])["c"]
    assert output_tokens(second) == output_tokens(reference)
    # Another tenant, another adapter, or another salt: never a hit.
    for i, kwargs in enumerate([{"tenant_id": "other"}, {"adapter_id": "a1"}, {"cache_salt": "s"}]):
        out = run_to_completion(engine, [EngineRequest(f"x{i}", prefix + question, greedy(2), **kwargs)])
        assert out[f"x{i}"][-1].num_cached_tokens == 0


def test_pool_too_small_for_all_requests_preempts_and_still_matches(tiny):
    prompts = random_prompts(8, 20, 60, seed=3)
    # 14 blocks of 16 tokens: each request needs up to 6; eight of them cannot run at once.
    engine = tiny.engine(num_blocks=14, max_model_len=512, max_num_batched_tokens=256)
    requests = [EngineRequest(f"p{i}", p, greedy(30, ignore_eos=True)) for i, p in enumerate(prompts)]
    outputs = run_to_completion(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert output_tokens(outputs[f"p{i}"]) == alone(tiny, prompt, 30)
    assert engine.block_manager.num_free_blocks == 14


def test_n_choices_share_the_prompt_blocks(tiny):
    prompt = random_prompts(1, 40, 41, seed=5)[0]
    engine = tiny.engine(kv_cache_bytes=4 << 20, max_model_len=512)
    engine.add_request(EngineRequest("n3", prompt, greedy(10, n=3, ignore_eos=True)))
    outputs = engine.step()  # prefill once; the two forks share its blocks
    tables = [s.block_table for s in engine.requests["n3"].seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    while engine.has_unfinished_requests():
        outputs += engine.step()
    expected = alone(tiny, prompt, 10)
    for index in range(3):
        assert [t for o in outputs for c in o.choices if c.index == index for t in c.token_ids] == expected
    assert engine.block_manager.num_free_blocks == engine.num_blocks
