"""The plug-in points other domains use: LoRA step context, adapter readiness, grammar, reasoning."""

from __future__ import annotations

import copy

import pytest
import torch
from enginecore_helpers import greedy, output_tokens, run_to_completion
from loraplex.engine.protocol import EngineRequest, FinishReason, ReasoningMarkers


@pytest.fixture(scope="module")
def tiny(tiny_family):
    return tiny_family("llama")[1]


class DenseLoRAStep:
    """A LoRA context in plain torch: y[rows, slice] += scale * x[rows] @ A.T @ B.T for adapted rows."""

    def __init__(self, rows: torch.Tensor, weights: dict, calls: list) -> None:
        self.rows = rows
        self.weights = weights
        self.calls = calls

    def apply(self, x, y, layer_index, slices) -> None:
        self.calls.append((layer_index, tuple(name for name, _, _ in slices)))
        for name, start, end in slices:
            ab = self.weights.get((layer_index, name))
            if ab is not None and len(self.rows):
                a, b = ab
                y[self.rows, start:end] += (x[self.rows] @ a.T) @ b.T


class DenseLoRABuilder:
    def __init__(self, weights: dict) -> None:
        self.weights = weights
        self.calls: list = []
        self.batches: list = []

    def build(self, seqs_in_batch_order, token_counts):
        self.batches.append([(s.request_id, n) for s, n in zip(seqs_in_batch_order, token_counts, strict=True)])
        flags = [s.adapter_id == "lora-1" for s, n in zip(seqs_in_batch_order, token_counts, strict=True)
                 for _ in range(n)]
        if not any(flags):
            return None
        return DenseLoRAStep(torch.tensor(flags).nonzero().squeeze(1), self.weights, self.calls)


def test_lora_hook_gets_named_slices_and_equals_merged_weights(tiny):
    generator = torch.Generator().manual_seed(7)
    config = tiny.config
    rank = 4
    weights = {}
    for layer in range(config.num_hidden_layers):
        for name, out_dim, in_dim in [("q_proj", 64, 64), ("v_proj", 32, 64), ("down_proj", 64, 128)]:
            weights[(layer, name)] = (torch.randn(rank, in_dim, generator=generator) * 0.3,
                                      torch.randn(out_dim, rank, generator=generator) * 0.3)
    builder = DenseLoRABuilder(weights)
    engine = tiny.engine(kv_cache_bytes=4 << 20, max_model_len=512)
    engine.runner.lora = builder
    prompt = list(range(10, 40))
    requests = [EngineRequest("base", prompt, greedy(12, ignore_eos=True)),
                EngineRequest("adapted", prompt, greedy(12, ignore_eos=True), adapter_id="lora-1")]
    outputs = run_to_completion(engine, requests)
    assert output_tokens(outputs["base"]) != output_tokens(outputs["adapted"])
    assert builder.batches[0] == [("base", 30), ("adapted", 30)]
    assert builder.batches[1] == [("base", 1), ("adapted", 1)]
    assert (0, ("q_proj", "k_proj", "v_proj")) in builder.calls
    assert (1, ("gate_proj", "up_proj")) in builder.calls and (1, ("down_proj",)) in builder.calls

    merged = copy.deepcopy(tiny.model)
    with torch.no_grad():
        for (layer, name), (a, b) in weights.items():
            module = merged.layers[layer].self_attn.qkv_proj if name != "down_proj" else merged.layers[layer].mlp.down_proj
            start, end = module.slice_of(name)
            module.weight[start:end] += b @ a
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    merged_engine = LLMEngine(merged, config, EngineConfig(kv_cache_bytes=4 << 20, max_model_len=512), tiny.tokenizer)
    reference = run_to_completion(merged_engine, [EngineRequest("m", prompt, greedy(12, ignore_eos=True))])
    assert output_tokens(outputs["adapted"]) == output_tokens(reference["m"])


def test_unready_adapter_waits_and_a_failing_adapter_fails_only_its_request(tiny):
    state = {"slow": False}

    def adapter_ready(adapter_id: str) -> bool:
        if adapter_id == "broken":
            raise RuntimeError("bad adapter weights")
        return state[adapter_id]

    engine = tiny.engine(kv_cache_bytes=4 << 20, max_model_len=512)
    engine.scheduler.adapter_ready = adapter_ready
    engine.add_request(EngineRequest("slow", [5, 6, 7], greedy(3, ignore_eos=True), adapter_id="slow"))
    engine.add_request(EngineRequest("broken", [5, 6, 7], greedy(3), adapter_id="broken"))
    engine.add_request(EngineRequest("base", [5, 6, 7], greedy(3, ignore_eos=True)))
    finished = {}
    for step in range(20):
        if step == 5:
            state["slow"] = True
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (step, out)
    assert finished["broken"][1].choices[0].finish_reason == FinishReason.ERROR
    assert "bad adapter weights" in finished["broken"][1].error
    assert finished["base"][0] < 5 <= finished["slow"][0]
    assert finished["slow"][1].choices[0].finish_reason == FinishReason.LENGTH


class AllowListGrammar:
    """Allows only `allowed` tokens, and terminates after `length` of them."""

    def __init__(self, allowed: list[int], length: int) -> None:
        self.allowed, self.length = allowed, length

    def new_matcher(self) -> AllowListMatcher:
        return AllowListMatcher(self.allowed, self.length)


class AllowListMatcher:
    def __init__(self, allowed: list[int], length: int) -> None:
        self.allowed, self.length, self.accepted = allowed, length, []

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id in self.allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token in self.allowed:
            word, bit = divmod(token, 32)
            bitmask[row, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def test_grammar_bitmask_restricts_tokens_per_choice_and_termination_stops(tiny):
    allowed = [3, 40, 95, 511, 31 + 32 * 7]
    engine = tiny.engine(kv_cache_bytes=4 << 20, max_model_len=512)
    from loraplex.engine.protocol import SamplingParams

    requests = [
        EngineRequest("g", [9, 8, 7], SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=2),
                      grammar=AllowListGrammar(allowed, 6)),
        EngineRequest("free", [9, 8, 7], greedy(8, ignore_eos=True)),
    ]
    outputs = run_to_completion(engine, requests)
    for index in (0, 1):
        tokens = output_tokens(outputs["g"], index)
        assert len(tokens) == 6 and set(tokens) <= set(allowed)
    finals = [c for o in outputs["g"] for c in o.choices if c.finish_reason]
    assert {c.finish_reason for c in finals} == {FinishReason.STOP}
    assert not set(output_tokens(outputs["free"])) <= set(allowed)


def test_xgrammar_regex_constrains_smollm2(smol):
    xgr = pytest.importorskip("xgrammar")

    class XGrammar:
        def __init__(self, compiled) -> None:
            self.compiled = compiled

        def new_matcher(self):
            matcher = xgr.GrammarMatcher(self.compiled)

            class Matcher:
                def accept_token(self, token_id: int) -> bool:
                    return matcher.accept_token(token_id)

                def fill_bitmask(self, bitmask, row: int) -> None:
                    matcher.fill_next_token_bitmask(bitmask, row)

                def is_terminated(self) -> bool:
                    return matcher.is_terminated()

            return Matcher()

    info = xgr.TokenizerInfo.from_huggingface(smol.tokenizer, vocab_size=smol.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_regex(r"(yes|no), [0-9]{3}")
    prompt = smol.tokenizer.encode("Is the sky blue? Answer and give a number:")
    engine = smol.engine()
    outputs = run_to_completion(engine, [EngineRequest("rx", prompt, greedy(20), grammar=XGrammar(compiled))])
    text = "".join(c.text for o in outputs["rx"] for c in o.choices)
    import re

    assert re.fullmatch(r"(yes|no), [0-9]{3}", text), text
    assert outputs["rx"][-1].choices[-1].finish_reason == FinishReason.STOP


def test_reasoning_budget_forces_the_end_marker_and_counts_thinking_tokens(tiny):
    end = [400, 401]
    markers = ReasoningMarkers(start_token_ids=[300], end_token_ids=end, starts_inside=True)
    engine = tiny.engine(kv_cache_bytes=4 << 20, max_model_len=512)
    params = greedy(12, ignore_eos=True, max_reasoning_tokens=5)
    outputs = run_to_completion(engine, [EngineRequest("think", [7, 8, 9], params, reasoning=markers)])
    tokens = output_tokens(outputs["think"])
    assert tokens[5:7] == end
    assert outputs["think"][-1].choices[0].num_reasoning_tokens == 7  # budget + the forced end marker
    assert engine.stats()["reasoning_tokens_total"] == 7
    assert len(tokens) == 12
