"""Tensor parallelism over NCCL: TP 2 and 4 against the CPU engine (float32, one process) on the
same random weights: greedy tokens equal with CUDA graphs on and off, with mixed LoRA adapters and
grammar rows in one batch, under preemption and prefix caching, for Llama and Qwen shapes;
bfloat16 prompt logprobs close to the single-GPU engine's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from enginecore_helpers import greedy, output_tokens, run_to_completion, tiny_random_config
from loraplex.engine.config import AdapterLimits, EngineConfig
from loraplex.engine.cuda.random_weights import RandomAdapterSource, SyntheticTokenizer
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.parallel.sources import RandomModelSource
from loraplex.engine.protocol import EngineRequest, SamplingParams
from test_cuda_engine import CONFIG, VOCAB, generate, mixed_requests, plain_requests, prompts

pytestmark = pytest.mark.gpu

QWEN3 = tiny_random_config(vocab_size=VOCAB, model_type="qwen3", head_dim=32, tie_word_embeddings=True,
                           num_attention_heads=8, num_key_value_heads=4)
# qkv bias; 2 KV heads, so at TP 4 each KV head is replicated on 2 ranks (head_dim 16: the kernels' least)
QWEN2 = tiny_random_config(vocab_size=VOCAB, model_type="qwen2")
SETTINGS = {"num_blocks": 96, "block_size": 16, "max_model_len": 256, "max_num_batched_tokens": 64,
            "max_num_seqs": 8}


def tp_sizes() -> list[Any]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [pytest.param(n, marks=pytest.mark.skipif(count < n, reason=f"needs {n} GPUs, {count} visible"))
            for n in (2, 4)]


def make_engine(config: Any, tp: int, device: str, *, lora: bool = False, dtype: str = "float32",
                **overrides: Any) -> LLMEngine:
    settings = EngineConfig(**SETTINGS | {"tensor_parallel_size": tp, "device": device, "dtype": dtype} | overrides)
    adapters = RandomAdapterSource(config, rank=8, dtype=settings.torch_dtype, std=0.1) if lora else None
    return LLMEngine.from_source(RandomModelSource(config, seed=0, lm_head_scale=10.0), settings,
                                 SyntheticTokenizer(VOCAB), adapters=adapters,
                                 adapter_limits=AdapterLimits(max_loras=4, max_cpu_loras=8, max_lora_rank=8))


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


@pytest.mark.parametrize("tp", tp_sizes())
def test_mixed_adapters_and_grammar_rows_equal_the_cpu_engine_graphs_on_and_off(tp: int, engines) -> None:
    expected = generate(make_engine(CONFIG, 1, "cpu", lora=True), mixed_requests())
    expected_plain = generate(make_engine(CONFIG, 1, "cpu"), plain_requests())
    # Overlapped scheduling on: plain greedy steps are launched ahead of the previous step's tokens
    # on every rank, each rank feeding its own copy of them (grammar rows make steps run one at a time).
    engines.append(engine := make_engine(CONFIG, tp, "cuda", lora=True, overlap_scheduling=True))
    assert engine.runner.model.layers[0].self_attn.num_heads == CONFIG.num_attention_heads // tp
    assert generate(engine, mixed_requests()) == expected
    assert engine.runner.num_graph_steps > 0
    assert any(key[1] is not None for key in engine.runner.graphs)  # a LoRA graph replayed on every rank
    ahead = engine.overlap.num_steps_ahead
    assert generate(engine, plain_requests()) == expected_plain
    assert engine.overlap.num_steps_ahead > ahead
    engine.runner.use_graphs = False
    graphs_before = engine.runner.num_graph_steps
    assert generate(engine, [EngineRequest(f"again{i}", r.prompt_token_ids, r.sampling, adapter_id=r.adapter_id,
                                           grammar=r.grammar) for i, r in enumerate(mixed_requests())]) == {
        f"again{i}": tokens for i, tokens in enumerate(expected.values())}
    assert engine.runner.num_graph_steps == graphs_before


@pytest.mark.parametrize("tp", tp_sizes())
@pytest.mark.parametrize("config", [QWEN3, QWEN2], ids=["qwen3", "qwen2"])
def test_qwen_shapes_under_preemption_and_prefix_caching_equal_the_cpu_engine(tp: int, config: Any,
                                                                              engines) -> None:
    small = {"num_blocks": 14, "max_num_batched_tokens": 48}

    def requests(tag: str) -> list[EngineRequest]:
        shared = prompts(1, seed=9)[0] * 8  # 24 shared tokens: a full block is cached
        return [EngineRequest(f"{tag}{i}", shared[:24] + p[:20], greedy(24, ignore_eos=True))
                for i, p in enumerate(prompts(5, seed=5))]

    expected = generate(make_engine(config, 1, "cpu", **small), requests("q"))
    engines.append(engine := make_engine(config, tp, "cuda", **small))
    assert generate(engine, requests("q")) == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("tp", tp_sizes())
def test_bfloat16_prompt_logprobs_close_to_the_single_gpu_engine(tp: int, engines) -> None:
    def requests() -> list[EngineRequest]:
        sampling = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        return [EngineRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts(8))]

    def run(engine: LLMEngine) -> dict[str, tuple[list[float], list[int]]]:
        out = {}
        for rid, outs in run_to_completion(engine, requests()).items():
            logprobs = [lp.logprob for o in outs if o.prompt_logprobs for lp in o.prompt_logprobs if lp is not None]
            out[rid] = (logprobs, output_tokens(outs))
        return out

    single = run(make_engine(CONFIG, 1, "cuda", dtype="bfloat16"))
    engines.append(engine := make_engine(CONFIG, tp, "cuda", dtype="bfloat16"))
    ours = run(engine)
    diffs = [abs(a - b) for rid in single for a, b in zip(single[rid][0], ours[rid][0], strict=True)]
    assert len(diffs) == sum(len(p) - 1 for p in prompts(8))
    assert max(diffs) < 0.2, max(diffs)
    assert sum(single[rid][1][:1] == ours[rid][1][:1] for rid in single) >= 6


@pytest.mark.parametrize("tp", tp_sizes())
def test_ngram_drafts_over_ranks_give_the_cpu_engines_tokens_with_graphs(tp: int, engines) -> None:
    """Speculative verification on every rank (verification graphs, overlapped scheduling between verification
    steps), adapter rows included: the prompts repeat a phrase, so drafts are proposed and mostly accepted; the
    float32 tokens are the CPU engine's without drafts, and no KV block stays held."""
    def requests() -> list[EngineRequest]:
        out = []
        for i, prompt in enumerate(prompts(6)):
            looping = (prompt[:3] * 40)[: len(prompt) + 24]
            out.append(EngineRequest(f"s{i}", looping, greedy(24, ignore_eos=True), adapter_id=[None, "a", "b"][i % 3]))
        return out

    expected = generate(make_engine(CONFIG, 1, "cpu", lora=True), requests())
    engines.append(engine := make_engine(CONFIG, tp, "cuda", lora=True, overlap_scheduling=True,
                                         speculative_decoding="ngram"))
    assert generate(engine, requests()) == expected
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens_total"] > stats["spec_decode_num_draft_tokens_total"] // 2 > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
