"""Speculative decoding in the engine (CPU, SmolLM2): the same greedy tokens with and without drafts for a
batch that mixes the base model, two trained adapters, a JSON-schema grammar and a session's next turn;
drafts accepted on a prompt whose answer quotes it; every block back afterwards, also when speculation is
cut short by preemption or an abort."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex.adapters.base_model import BaseModelSpec
from loraplex.adapters.source import FolderAdapterSource
from loraplex.engine.config import AdapterLimits, EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, SamplingParams
from loraplex.grammar.compiler import GrammarCompilerService
from loraplex.grammar.spec import GrammarKind, GrammarSpec

QUOTE = ("Copy this list exactly, one item per line: red apple, green pear, yellow banana, red apple, "
         "green pear, yellow banana, red apple, green pear.")
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                 "required": ["name", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def trained_adapters(smollm_path: Path) -> dict[str, Path]:
    from train_adapters import ensure_trained_adapters

    return ensure_trained_adapters(smollm_path)


@pytest.fixture(scope="module")
def compiler(smol: Any) -> Iterator[GrammarCompilerService]:
    service = GrammarCompilerService(smol.tokenizer, smol.config.vocab_size)
    yield service
    service.close()


def chat(smol: Any, *turns: str) -> list[int]:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return list(smol.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def make_engine(smol: Any, folders: dict[str, Path], mode: str, **overrides: Any) -> LLMEngine:
    settings = {"num_blocks": 160, "max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 1024,
                "dtype": "float32", "device": "cpu", "speculative_decoding": mode} | overrides
    source = FolderAdapterSource(folders, BaseModelSpec.from_model_dir(smol.path), torch.float32)
    return LLMEngine(smol.model, smol.config, EngineConfig(**settings), smol.tokenizer, adapters=source,
                     adapter_limits=AdapterLimits(max_loras=2, max_cpu_loras=4, max_lora_rank=64))


def drain(engine: LLMEngine, timeout_s: float = 600.0) -> dict[str, list[int]]:
    """Step until every request finished; each request's tokens. After every step: no drafts outlive their
    step, and no sequence holds a block past its tokens (rejected drafts' blocks went back at once)."""
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    bm = engine.block_manager
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        outputs = engine.step()
        for seq in engine.scheduler.running:
            assert not seq.spec_token_ids
            assert len(seq.block_table) <= bm.blocks_needed(len(seq.token_ids))
        if not outputs and engine.scheduler.num_running == 0:
            time.sleep(0.01)  # adapters still loading
        assert all(out.error is None for out in outputs), [out.error for out in outputs]
        collect(outputs, tokens)
    return tokens


def mixed_batch(smol: Any, compiler: GrammarCompilerService, session_turn: list[int]) -> list[EngineRequest]:
    person = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, PERSON_SCHEMA))
    return [
        EngineRequest("quote", chat(smol, QUOTE), greedy(48), tenant_id="a"),
        EngineRequest("pirate", chat(smol, "What is the capital of France?"), greedy(24), tenant_id="b",
                      adapter_id="pirate"),
        EngineRequest("upper", chat(smol, "Repeat after me: the sea is big and deep, the sea is big."), greedy(32),
                      tenant_id="c", adapter_id="upper"),
        EngineRequest("json", chat(smol, "Alice lives in Paris. Give her name and city as JSON."), greedy(40),
                      tenant_id="a", grammar=person),
        EngineRequest("turn-2", session_turn, greedy(32), tenant_id="d", session_id="sess"),
    ]


def run_mixed(smol: Any, compiler: GrammarCompilerService, folders: dict[str, Path], mode: str
              ) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = make_engine(smol, folders, mode)
    first = chat(smol, QUOTE)
    engine.add_request(EngineRequest("turn-1", first, greedy(24), tenant_id="d", session_id="sess"))
    tokens = drain(engine)
    answer = smol.tokenizer.decode(tokens["turn-1"], skip_special_tokens=True)
    # The next turn: the transcript (whose KV the session pinned) and a new question that quotes it.
    second = chat(smol, QUOTE, answer, "Say that list again.")
    for request in mixed_batch(smol, compiler, second):
        engine.add_request(request)
    tokens |= drain(engine)
    return tokens, engine


def test_mixed_batch_greedy_identical_with_and_without_speculation(
        smol: Any, compiler: GrammarCompilerService, trained_adapters: dict[str, Path]) -> None:
    folders = {"pirate": trained_adapters["pirate"], "upper": trained_adapters["upper"]}
    plain, plain_engine = run_mixed(smol, compiler, folders, "off")
    drafted, engine = run_mixed(smol, compiler, folders, "ngram")
    assert drafted == plain
    assert plain_engine.stats()["spec_decode_num_draft_tokens_total"] == 0
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens_total"] > 0  # the quoting answers take drafts
    assert stats["spec_decode_num_accepted_tokens_total"] <= stats["spec_decode_num_draft_tokens_total"]
    assert stats["generation_tokens_total"] == plain_engine.stats()["generation_tokens_total"]  # billing unchanged
    assert stats["prefix_cache_hits"] > 0  # the session's turn 2 ran on its pinned transcript
    assert engine.release_session("sess")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    engine.close()
    plain_engine.close()


def test_preemption_and_abort_in_the_middle_of_speculation_leak_nothing(smol: Any) -> None:
    """A pool too small for four drafting requests: they preempt one another (drafts and all), and one is
    aborted while the others draft; the rest still produce their plain greedy tokens, every block comes back."""
    prompts = {f"r{i}": chat(smol, f"{QUOTE} ({i})") for i in range(4)}

    def start(mode: str) -> LLMEngine:
        engine = smol.engine(num_blocks=14, max_num_seqs=4, speculative_decoding=mode, fair_sharing=False)
        for request_id, prompt in prompts.items():
            engine.add_request(EngineRequest(request_id, prompt, greedy(40)))
        return engine

    plain = drain(start("off"))
    engine = start("ngram")
    tokens: dict[str, list[int]] = {}
    while engine.stats()["spec_decode_num_accepted_tokens_total"] == 0:
        collect(engine.step(), tokens)
    collect([engine.abort("r3")], tokens)
    collect_all(drain(engine), tokens)
    assert engine.scheduler.num_preemptions > 0
    assert {request_id: tokens[request_id] for request_id in ("r0", "r1", "r2")} == {
        request_id: plain[request_id] for request_id in ("r0", "r1", "r2")}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def collect(outputs: list[Any], tokens: dict[str, list[int]]) -> None:
    for out in outputs:
        got = tokens.setdefault(out.request_id, [])
        for choice in out.choices:
            got.extend(choice.token_ids)


def collect_all(more: dict[str, list[int]], tokens: dict[str, list[int]]) -> None:
    for request_id, got in more.items():
        tokens.setdefault(request_id, []).extend(got)
