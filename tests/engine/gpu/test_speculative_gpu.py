"""Speculative decoding on the CUDA runner (SmolLM2's real weights): the same greedy tokens with n-gram drafts
as without, for a small batch whose answers quote their prompts (so drafts are accepted and verification rows
run beside decode-graph steps), in float32 and in bfloat16 (what `serve` runs on a GPU); no KV block is left
held afterwards, and the per-position counters add up to the totals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from enginecore_helpers import greedy, output_tokens, run_to_completion
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.cuda.runner import CudaModelRunner
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.model.loader import load_model
from loraplex.engine.protocol import EngineRequest

pytestmark = pytest.mark.gpu

MAX_LEN = 1024
QUOTING_PROMPTS = [
    "Copy this list exactly, one item per line: red apple, green pear, yellow banana, red apple, green pear.",
    "Read the text and write its fields one per line as `name: ...`, `age: ...`, `city: ...`.\n\n"
    "Text: Dana Kowalski is 41 years old and lives in Krakow.",
    "Rewrite this Python function so that it is named `total_prices` instead of `sum_prices`. Reply with the code "
    "only.\n\n```python\ndef sum_prices(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total\n```",
    "Repeat after me: the sea is big and deep, the sea is big and deep.",
]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request: pytest.FixtureRequest, smollm_path: Path) -> tuple[Any, ModelConfig, Any, str]:
    from transformers import AutoTokenizer

    dtype = request.param
    config = EngineConfig(dtype=dtype, device="cuda")
    model = load_model(smollm_path, MAX_LEN, config.torch_dtype, "cuda")
    return model, ModelConfig.from_pretrained(smollm_path), AutoTokenizer.from_pretrained(smollm_path), dtype


def make_engine(loaded: tuple[Any, ModelConfig, Any, str], mode: str) -> LLMEngine:
    model, model_config, tokenizer, dtype = loaded
    config = EngineConfig(num_blocks=256, max_model_len=MAX_LEN, max_num_seqs=8, dtype=dtype, device="cuda",
                          speculative_decoding=mode)
    return LLMEngine(model, model_config, config, tokenizer)


def generate(engine: LLMEngine, tokenizer: Any) -> dict[str, list[int]]:
    requests = []
    for i, text in enumerate(QUOTING_PROMPTS):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               return_dict=False)
        requests.append(EngineRequest(f"r{i}", list(prompt), greedy(48)))
    return {rid: output_tokens(outs) for rid, outs in run_to_completion(engine, requests).items()}


def test_greedy_tokens_identical_with_ngram_drafts_and_no_block_held(
        loaded: tuple[Any, ModelConfig, Any, str]) -> None:
    tokenizer = loaded[2]
    plain_engine, engine = make_engine(loaded, "off"), make_engine(loaded, "ngram")
    assert isinstance(engine.runner, CudaModelRunner) and engine.runner.use_graphs
    expected = generate(plain_engine, tokenizer)
    assert generate(engine, tokenizer) == expected
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] <= stats["spec_decode_num_draft_tokens_total"]
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens_total"]
    assert sum(stats["spec_decode_num_draft_tokens_per_pos"]) == stats["spec_decode_num_draft_tokens_total"]
    # Verification steps replayed their graphs (beside the decode graphs of steps without drafts): none ran eagerly.
    assert engine.runner.num_mixed_graph_steps > 0 and engine.runner.num_eager_steps == 0
    assert plain_engine.runner.num_graph_steps > 0
    for e in (plain_engine, engine):
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
        assert not e.has_unfinished_requests()
        e.close()
