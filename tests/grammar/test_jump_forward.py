"""Jump-forward (forced tokens appended without sampling) gives the same tokens as the step-by-step path,
and a budget-closed output is complete JSON with finish_reason `length`."""

from __future__ import annotations

import json

import jsonschema
import pytest
from loraplex.engine.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, SamplingParams
from loraplex.grammar.spec import GrammarKind, GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "conditions": {"enum": ["sunny", "cloudy", "light rain", "heavy snow"]},
        "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
        "forecast": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": {"type": "object", "properties": {"day": {"type": "string", "maxLength": 12},
                                                                "high_c": {"type": "integer"}},
                               "required": ["day", "high_c"], "additionalProperties": False}},
    },
    "required": ["city", "conditions", "temperature_c", "forecast"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return LLMEngine.from_model_path(model_dir, EngineConfig(max_model_len=1024, kv_cache_bytes=256 << 20,
                                                             enable_prefix_caching=False))


def prompt(tokenizer) -> list[int]:
    chat = [{"role": "user", "content": "Report the weather in Oslo as JSON."}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate(engine: LLMEngine, grammar, prompt_ids: list[int], *, jump: bool, **sampling) -> list[tuple]:
    """(token ids, text, finish reason) per request, and the engine steps it took."""
    engine.config.grammar_jump_forward = jump
    requests = [EngineRequest(f"jf-{jump}-{i}", prompt_ids, SamplingParams(**kw), grammar=grammar)
                for i, kw in enumerate(sampling["cases"])]
    for request in requests:
        engine.add_request(request)
    results = {r.request_id: [[], "", None] for r in requests}
    num_steps = 0
    while engine.has_unfinished_requests():
        num_steps += 1
        for out in engine.step():
            for choice in out.choices:
                entry = results[out.request_id]
                entry[0] += choice.token_ids
                entry[1] += choice.text
                entry[2] = choice.finish_reason or entry[2]
    return [tuple(results[r.request_id]) for r in requests], num_steps


# The shortest document this schema allows is about 39 tokens as the closing plan spells it.
CASES = [
    {"max_tokens": 90, "temperature": 0.0},
    {"max_tokens": 90, "temperature": 1.0, "seed": 11, "top_p": 0.9},
    {"max_tokens": 42, "temperature": 0.8, "seed": 5},   # the budget closes this one
]


def test_jump_forward_and_step_by_step_emit_the_same_tokens(engine, compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, strict=True))
    ids = prompt(tokenizer)
    stepped, stepped_steps = generate(engine, grammar, ids, jump=False, cases=CASES)
    jumped_before = engine.num_jump_forward_tokens_total
    jumped, jumped_steps = generate(engine, grammar, ids, jump=True, cases=CASES)
    assert jumped == stepped
    assert engine.num_jump_forward_tokens_total - jumped_before > 20  # keys and punctuation were jumped
    assert jumped_steps < stepped_steps
    for _, text, finish in jumped:
        jsonschema.validate(json.loads(text), SCHEMA)  # every output is complete and valid
        assert finish in ("stop", "length")
    assert jumped[-1][2] == "length" and len(jumped[-1][0]) <= 42  # closed by the budget, still valid


def test_budget_close_is_valid_for_small_budgets(engine, compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, strict=True))
    cases = [{"max_tokens": max_tokens, "temperature": 1.2, "seed": s} for s, max_tokens in enumerate((40, 48, 60))]
    results, _ = generate(engine, grammar, prompt(tokenizer), jump=True, cases=cases)
    for (tokens, text, finish), case in zip(results, cases, strict=True):
        assert len(tokens) <= case["max_tokens"]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert finish in ("stop", "length")
