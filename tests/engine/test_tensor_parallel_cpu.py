"""Tensor parallelism over gloo on the CPU: the real model code split over 2 worker processes
gives the single-process engine's greedy tokens, with mixed LoRA adapters (sharded S-LoRA
style), prompt logprobs, prefix caching and preemption; and, loading a checkpoint shard by
shard, transformers' tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from enginecore_helpers import greedy, output_tokens, run_to_completion, tiny_random_config
from loraplex.engine.config import AdapterLimits, EngineConfig
from loraplex.engine.cuda.random_weights import RandomAdapterSource, SyntheticTokenizer
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.parallel.sources import PathModelSource, RandomModelSource
from loraplex.engine.protocol import EngineRequest, SamplingParams
from test_greedy_matches_transformers import hf_greedy

VOCAB = 1000
LLAMA = tiny_random_config(vocab_size=VOCAB)
QWEN3 = tiny_random_config(vocab_size=VOCAB, model_type="qwen3", head_dim=32, tie_word_embeddings=True)


def make_engine(config: Any, tp: int, *, lora: bool = False, **overrides: Any) -> LLMEngine:
    settings = {"num_blocks": 96, "block_size": 16, "max_model_len": 256, "max_num_batched_tokens": 64,
                "max_num_seqs": 8, "tensor_parallel_size": tp} | overrides
    source = RandomModelSource(config, seed=0, lm_head_scale=10.0)  # peaked logits: no greedy ties
    adapters = RandomAdapterSource(config, rank=8, std=0.1) if lora else None
    return LLMEngine.from_source(source, EngineConfig(**settings), SyntheticTokenizer(VOCAB), adapters=adapters,
                                 adapter_limits=AdapterLimits(max_loras=4, max_cpu_loras=8, max_lora_rank=8))


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def mixed_requests(tag: str) -> list[EngineRequest]:
    out = []
    for i, prompt in enumerate(prompts([3, 17, 40, 64, 90, 5, 33, 128])):
        sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                  prompt_logprobs=0 if i in (2, 4) else None)
        out.append(EngineRequest(f"{tag}{i}", prompt, sampling, adapter_id=[None, "a", "b", "c"][i % 4]))
    return out


def run(engine: LLMEngine, requests: list[EngineRequest]) -> tuple[dict, dict]:
    outputs = run_to_completion(engine, requests)
    tokens = {rid[-1]: output_tokens(outs) for rid, outs in outputs.items()}
    logprobs = {rid[-1]: [lp.logprob for o in outs if o.prompt_logprobs for lp in o.prompt_logprobs if lp is not None]
                for rid, outs in outputs.items()}
    return tokens, logprobs


def test_tp2_equals_tp1_with_mixed_adapters_prompt_logprobs_and_prefix_hits(engines: list[LLMEngine]) -> None:
    single = make_engine(LLAMA, 1, lora=True)
    # Overlapped scheduling on: plain greedy steps run ahead on every rank (the CPU runner's
    # launches run at once, so this checks the bookkeeping; the GPU test runs them in flight).
    engines.append(parallel := make_engine(LLAMA, 2, lora=True, overlap_scheduling=True))
    assert parallel.runner.workers is not None
    assert parallel.runner.model.layers[0].self_attn.num_heads == LLAMA.num_attention_heads // 2
    expected, expected_lp = run(single, mixed_requests("first"))
    got, got_lp = run(parallel, mixed_requests("first"))
    assert got == expected
    assert all(len(t) == 10 for t in got.values())
    for key in ("2", "4"):
        assert len(got_lp[key]) == len(expected_lp[key]) > 0
        assert max(abs(a - b) for a, b in zip(got_lp[key], expected_lp[key], strict=True)) < 1e-4
    # The same prompts again come from the prefix cache on every rank and still agree.
    hits = parallel.stats()["prefix_cache_hits"]
    again, _ = run(parallel, mixed_requests("again"))
    assert again == expected
    assert parallel.stats()["prefix_cache_hits"] > hits
    assert parallel.overlap.num_steps_ahead > 0
    # The adapters matter: request 1 without its adapter decodes differently.
    base, _ = run(single, [EngineRequest("x1", prompts([3, 17])[1], greedy(10, ignore_eos=True))])
    assert base["1"] != got["1"]


def test_tp2_qwen3_under_preemption_equals_tp1(engines: list[LLMEngine]) -> None:
    """q/k norm, tied vocab-parallel embedding and head; a pool so small that sequences are preempted."""
    small = {"num_blocks": 14, "max_num_batched_tokens": 48}
    requests = lambda: [EngineRequest(f"q{i}", p, greedy(24, ignore_eos=True))  # noqa: E731
                        for i, p in enumerate(prompts([20, 30, 40, 25, 35], seed=5))]
    expected, _ = run(make_engine(QWEN3, 1, **small), requests())
    engines.append(parallel := make_engine(QWEN3, 2, **small))
    got, _ = run(parallel, requests())
    assert got == expected
    assert parallel.stats()["num_preemptions"] > 0


def test_tp2_loads_a_checkpoint_shard_by_shard_and_matches_transformers(tiny_family, engines: list[LLMEngine]
                                                                         ) -> None:
    hf, ours = tiny_family("qwen2")  # qkv bias (column-parallel), tied embeddings, linear rope scaling
    config = EngineConfig(kv_cache_bytes=4 << 20, max_model_len=512, max_num_batched_tokens=64,
                          tensor_parallel_size=2)
    engines.append(engine := LLMEngine.from_source(PathModelSource(str(ours.path)), config, ours.tokenizer))
    prompt_list = prompts([5, 37, 90], seed=1)
    requests = [EngineRequest(f"h{i}", [3 + t % 509 for t in p], greedy(16, ignore_eos=True))
                for i, p in enumerate(prompt_list)]
    outputs = run_to_completion(engine, requests)
    for request in requests:
        assert output_tokens(outputs[request.request_id]) == hf_greedy(hf, request.prompt_token_ids, 16, None)


def test_tensor_parallel_engine_needs_its_workers() -> None:
    from loraplex.engine.model.loader import random_model

    model = random_model(LLAMA, 256)
    with pytest.raises(ValueError, match="worker processes"):
        LLMEngine(model, LLAMA, EngineConfig(num_blocks=8, tensor_parallel_size=2), SyntheticTokenizer(VOCAB))


def test_a_dead_worker_fails_the_step_instead_of_hanging(engines: list[LLMEngine]) -> None:
    engines.append(engine := make_engine(LLAMA, 2))
    process = engine.runner.workers._processes[0]
    process.kill()
    process.join(timeout=30)
    engine.add_request(EngineRequest("dead", prompts([8])[0], greedy(4, ignore_eos=True)))
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["dead"] and outputs[0].finished
    assert "worker 1 exited" in (outputs[0].error or "")


def test_tp2_with_ngram_drafts_gives_the_single_process_tokens_and_holds_no_block(engines: list[LLMEngine]) -> None:
    """Speculative verification over 2 ranks: each rank runs the draft rows with its shard (adapter rows
    included) and every rank keeps what the driver's verification keeps; the prompts repeat a phrase, so
    drafts are proposed and mostly accepted."""
    def requests() -> list[EngineRequest]:
        out = []
        for i, prompt in enumerate(prompts([12, 40, 7, 64])):
            looping = (prompt[:6] * 12)[: len(prompt) + 20]
            out.append(EngineRequest(f"s{i}", looping, greedy(24, ignore_eos=True), adapter_id=[None, "a", None, "b"][i]))
        return out

    expected, _ = run(make_engine(LLAMA, 1, lora=True), requests())
    engines.append(parallel := make_engine(LLAMA, 2, lora=True, speculative_decoding="ngram"))
    got, _ = run(parallel, requests())
    assert got == expected and all(len(t) == 24 for t in got.values())
    stats = parallel.stats()
    assert stats["spec_decode_num_accepted_tokens_total"] > stats["spec_decode_num_draft_tokens_total"] // 2 > 0
    assert parallel.block_manager.num_free_blocks == parallel.block_manager.num_blocks  # rejected drafts' too
