"""Greedy output equals transformers `generate`, token for token, in float32, and logprobs equal its logits.

The one module that loads transformers' copy of SmolLM2, so it is freed when the module ends."""

from __future__ import annotations

import pytest
import torch
from enginecore_helpers import greedy, output_tokens, run_to_completion
from loraplex.engine.protocol import EngineRequest

MAX_NEW = 24


@pytest.fixture(scope="module")
def smol_hf(smollm_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos or 0
    )
    return out[0, len(prompt):].tolist()


def test_smollm2_eight_prompts_match_transformers(smol, smol_hf, chat_prompt_ids):
    engine = smol.engine()
    requests = [EngineRequest(f"p{i}", ids, greedy(MAX_NEW)) for i, ids in enumerate(chat_prompt_ids)]
    outputs = run_to_completion(engine, requests)
    eos = smol.tokenizer.eos_token_id
    for i, ids in enumerate(chat_prompt_ids):
        ours = output_tokens(outputs[f"p{i}"])
        theirs = hf_greedy(smol_hf, ids, MAX_NEW, eos)
        assert ours == theirs, f"prompt {i}: {smol.tokenizer.decode(ours)!r} != {smol.tokenizer.decode(theirs)!r}"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_random_families_match_transformers(tiny_family, family):
    hf, ours = tiny_family(family)
    engine = ours.engine(kv_cache_bytes=4 << 20, max_model_len=512, max_num_batched_tokens=64)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 37, 90)]
    requests = [EngineRequest(f"{family}{i}", p, greedy(20, ignore_eos=True)) for i, p in enumerate(prompts)]
    outputs = run_to_completion(engine, requests)
    for i, prompt in enumerate(prompts):
        assert output_tokens(outputs[f"{family}{i}"]) == hf_greedy(hf, prompt, 20, None)


def test_prompt_logprobs_and_logprobs_match_transformers(smol, smol_hf, chat_prompt_ids):
    prompt = chat_prompt_ids[0]
    engine = smol.engine(max_num_batched_tokens=16)  # prompt logprobs gathered across chunks
    params = greedy(3, logprobs=2, prompt_logprobs=1)
    outputs = run_to_completion(engine, [EngineRequest("lp", prompt, params)])["lp"]
    with torch.no_grad():
        reference = torch.log_softmax(smol_hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    prompt_lps = outputs[0].prompt_logprobs
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for i in range(1, len(prompt)):
        entry = prompt_lps[i]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(reference[i - 1, prompt[i]]), abs=2e-3)
        assert len(entry.top) == 1
    first = outputs[0].choices[0].logprobs[0]
    assert first.token_id == first.top[0][0]  # greedy picks the top token
    assert first.logprob == pytest.approx(float(reference[-1].max()), abs=2e-3)


def test_prompt_logprobs_scored_a_few_rows_at_a_time_still_match_transformers(smol, smol_hf, chat_prompt_ids,
                                                                               monkeypatch):
    # A chunk's prompt logits are made PROMPT_LOGIT_ROWS rows at a time (never the chunk's all at once): with 5,
    # each 16-token chunk is scored in pieces of 5, 5, 5 and 1, the last of a span having no target yet.
    from loraplex.engine import runner

    monkeypatch.setattr(runner, "PROMPT_LOGIT_ROWS", 5)
    prompt = chat_prompt_ids[1]
    engine = smol.engine(max_num_batched_tokens=16)
    outputs = run_to_completion(engine, [EngineRequest("pieces", prompt, greedy(2, prompt_logprobs=3))])["pieces"]
    with torch.no_grad():
        reference = torch.log_softmax(smol_hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    prompt_lps = outputs[0].prompt_logprobs
    assert len(prompt) > 20 and prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for i in range(1, len(prompt)):
        entry = prompt_lps[i]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(reference[i - 1, prompt[i]]), abs=2e-3)
        assert [t for t, _ in entry.top] == reference[i - 1].topk(3).indices.tolist()
