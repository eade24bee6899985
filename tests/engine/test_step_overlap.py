"""Overlapped scheduling (engine/step_overlap.py): the same tokens with it on and off.

The CPU runner runs each launched step at once, so these tests check the engine's bookkeeping:
placeholders given and taken back, rows of sequences that finished meanwhile dropped, requests
admitted or aborted while a step is in flight, steps that cannot run ahead (sampling on the
host, a grammar, prefill chunks, preemption, the context limit) finishing the in-flight step
first. tests/engine/gpu/test_cuda_engine.py runs the same workload on the CUDA runner, whose
steps really are in flight.
"""

from __future__ import annotations

from typing import Any

import torch
from enginecore_helpers import tiny_random_config
from loraplex.engine.config import EngineConfig
from loraplex.engine.cuda.random_weights import SyntheticTokenizer
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, ReasoningMarkers, SamplingParams

VOCAB = 1000
CONFIG = tiny_random_config(vocab_size=VOCAB)


def make_engine(overlap: bool, device: str = "cpu", **overrides: Any) -> LLMEngine:
    settings = {"num_blocks": 96, "block_size": 16, "max_model_len": 128, "max_num_batched_tokens": 64,
                "max_num_seqs": 8, "device": device, "overlap_scheduling": overlap} | overrides
    return LLMEngine.from_random(CONFIG, EngineConfig(**settings), SyntheticTokenizer(VOCAB), seed=0)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def workload(engine: LLMEngine) -> dict[str, list[int]]:
    """Greedy requests finishing at different steps, one admitted and one aborted mid-run, seeded ones
    drawing at a temperature alone (they run ahead) and one with top-p too (it does not), one reaching the
    context limit."""
    def greedy(n: int, **kw: Any) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)

    requests = [EngineRequest(f"g{i}", prompt(i, 5 + 7 * i), greedy(6 + 5 * i)) for i in range(4)]
    requests.append(EngineRequest("edge", prompt(9, 100), greedy(28)))  # ends at max_model_len 128
    requests += [EngineRequest(f"hot{i}", prompt(20 + i, 10), SamplingParams(
        max_tokens=12 + 3 * i, temperature=[0.7, 1.5][i], seed=30 + i, ignore_eos=True)) for i in range(2)]
    filtered = EngineRequest("filtered", prompt(11, 7), SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9,
                                                                       seed=6, ignore_eos=True))
    late = EngineRequest("late", prompt(7, 40), greedy(9))
    seeded = EngineRequest("seeded", prompt(8, 12), SamplingParams(max_tokens=8, temperature=0.8, seed=5,
                                                                    ignore_eos=True))
    doomed = EngineRequest("doomed", prompt(10, 9), greedy(50))
    for request in [*requests, doomed]:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    for step in range(400):
        if step == 4:
            engine.add_request(late)
        if step == 9:
            engine.abort("doomed")
        if step == 14:
            engine.add_request(seeded)
        if step == 24:
            engine.add_request(filtered)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for c in out.choices for t in c.token_ids)
        if step > 14 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    return tokens


def test_overlap_gives_the_same_tokens_and_runs_ahead() -> None:
    expected = workload(make_engine(overlap=False))
    engine = make_engine(overlap=True)
    got = workload(engine)
    # an aborted request keeps what it got so far: one step fewer, since a step's tokens reach the
    # caller one step() call later with overlap on
    doomed, doomed_expected = got.pop("doomed"), expected.pop("doomed")
    assert 0 < len(doomed) < len(doomed_expected) < 50 and doomed == doomed_expected[: len(doomed)]
    assert got == expected
    assert len(got["g3"]) == 21 and len(got["late"]) == 9 and len(got["edge"]) == 28
    assert engine.overlap.num_steps_ahead > 10  # most decode steps were launched ahead
    assert engine.overlap.num_rows_dropped > 0  # rows of sequences that had finished one step before
    # Each step is counted once by how it ran: the top-p row ("filtered") samples on the host, so the steps
    # after each of its own wait for the device ("not_plain"); /metrics shows these under the same names.
    outcomes = engine.stats()["overlap_steps"]
    assert outcomes["ahead"] == engine.overlap.num_steps_ahead
    assert outcomes["not_plain"] >= len(got["filtered"]) - 1 and outcomes["launched"] > 0
    assert outcomes["launch_failed"] == 0 and outcomes["drafts"] == 0
    assert make_engine(overlap=False).stats()["overlap_steps"] == {}
    assert engine.overlap.pending is None or all(s.is_finished for s in engine.overlap.pending.scheduled.seqs)


def test_placeholders_never_outlive_a_step() -> None:
    engine = make_engine(overlap=True)
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", prompt(i, 6), SamplingParams(max_tokens=20, temperature=0.0,
                                                                                 ignore_eos=True)))
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        pending = engine.overlap.pending
        in_flight = dict(zip([s.seq_id for s in pending.scheduled.seqs], pending.scheduled.num_new_tokens,
                             strict=True)) if pending is not None else {}
        for seq in engine.scheduler.running:
            # between steps each sequence holds its real tokens: the in-flight step's rows are not counted as
            # computed yet and its sampled token is not appended; everything else but the last token is computed
            assert seq.num_computed_tokens + in_flight.get(seq.seq_id, 1) == len(seq.token_ids)
            assert len(seq.token_ids) - seq.num_prompt_tokens <= 20
            seen += 1
    assert seen > 0 and engine.overlap.num_steps_ahead > 0


def test_preemption_and_tiny_pools_fall_back_with_the_same_tokens() -> None:
    # 12 blocks of 16 for 4 sequences growing to ~60 tokens: blocks run out and sequences are preempted
    def run(overlap: bool) -> tuple[dict[str, list[int]], int]:
        engine = make_engine(overlap, num_blocks=12)
        for i in range(4):
            engine.add_request(EngineRequest(f"p{i}", prompt(20 + i, 20), SamplingParams(
                max_tokens=40, temperature=0.0, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(t for c in out.choices for t in c.token_ids)
        return tokens, engine.scheduler.num_preemptions

    expected, preemptions = run(False)
    got, _ = run(True)
    assert preemptions > 0
    assert got == expected
    # the room check: nothing is scheduled ahead without blocks for a whole step beside one more token each
    engine = make_engine(True, num_blocks=12)
    for i in range(4):
        engine.add_request(EngineRequest(f"p{i}", prompt(20 + i, 20), SamplingParams(max_tokens=40, temperature=0.0,
                                                                                     ignore_eos=True)))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.overlap.outcomes["room"] > 0


def test_on_for_gpus_off_on_the_cpu() -> None:
    assert EngineConfig().resolve_overlap_scheduling() is False  # the CPU: a launched step runs at once
    assert EngineConfig(device="cuda").resolve_overlap_scheduling() is True
    assert EngineConfig(device="cuda", overlap_scheduling=False).resolve_overlap_scheduling() is False
    assert make_engine(overlap=False).overlap is None
    assert LLMEngine.from_random(CONFIG, EngineConfig(num_blocks=32, max_model_len=128), SyntheticTokenizer(VOCAB),
                                 seed=0).overlap is None


def mid_flight_arrivals(engine: LLMEngine) -> dict[str, list[int]]:
    """Requests arriving while steps are in flight: prompts chunked over several steps, prompts whose prefix is
    cached (their first row is one token, known on the host, beside decodes fed from the device), seeded rows
    at a temperature."""
    shared = prompt(40, 48)
    arrivals = {0: [EngineRequest("first", prompt(41, 10), SamplingParams(max_tokens=40, temperature=0.0,
                                                                           ignore_eos=True))]}
    for i in range(6):
        cached = EngineRequest(f"cached{i}", shared + prompt(50 + i, 1 + (i % 2) * 20),
                               SamplingParams(max_tokens=8 + i, temperature=0.0, ignore_eos=True))
        long = EngineRequest(f"long{i}", prompt(60 + i, 150), SamplingParams(max_tokens=6, temperature=0.0,
                                                                             ignore_eos=True))
        hot = EngineRequest(f"hot{i}", prompt(70 + i, 12), SamplingParams(max_tokens=10, temperature=0.9,
                                                                          seed=80 + i, ignore_eos=True))
        arrivals[3 + 4 * i] = [cached, hot] + ([long] if i % 3 == 0 else [])
    tokens: dict[str, list[int]] = {}
    for step in range(2000):
        for request in arrivals.pop(step, []):
            engine.add_request(request)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for c in out.choices for t in c.token_ids)
        if not arrivals and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests() and len(tokens) == 1 + 6 * 2 + 2
    return tokens


def test_requests_arriving_mid_flight_are_admitted_ahead_with_the_same_tokens() -> None:
    """New requests join a step launched ahead of the one in flight, and an in-flight prompt chunk is counted
    once: the same tokens as without overlap, no block left behind."""
    expected = mid_flight_arrivals(make_engine(False, max_model_len=256))
    engine = make_engine(True, max_model_len=256)
    assert mid_flight_arrivals(engine) == expected
    assert engine.overlap.num_prompt_steps_ahead > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def reasoning_workload(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Chat-like requests carrying reasoning markers (as every chat request does, to count thinking tokens),
    generation starting inside the segment: without a budget, and with budgets of 1, 3 and 7 (the end marker is
    forced once a budget is spent); the one without a budget runs on alone after the others end."""
    markers = ReasoningMarkers(start_token_ids=[300], end_token_ids=[301, 302], starts_inside=True)
    budgets = {"free": None, "b1": 1, "b3": 3, "b7": 7}
    for i, (name, budget) in enumerate(budgets.items()):
        engine.add_request(EngineRequest(name, prompt(90 + i, 9), SamplingParams(
            max_tokens=40 if budget is None else 16, temperature=0.0, ignore_eos=True, max_reasoning_tokens=budget),
            reasoning=markers))
    tokens: dict[str, list[int]] = {}
    thinking: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for c in out.choices for t in c.token_ids)
            thinking[out.request_id] = out.choices[0].num_reasoning_tokens if out.choices else 0
    return tokens, thinking


def test_reasoning_markers_run_ahead_and_budgets_stay_exact() -> None:
    expected, expected_thinking = reasoning_workload(make_engine(overlap=False))
    engine = make_engine(overlap=True)
    got, thinking = reasoning_workload(engine)
    assert got == expected and thinking == expected_thinking
    for name, budget in (("b1", 1), ("b3", 3), ("b7", 7)):  # the end marker comes right after the budget
        assert got[name][budget: budget + 2] == [301, 302], (name, got[name])
    assert 301 not in got["free"][:2]
    # markers without a budget do not hold the host back: once the budgeted requests end (each could still
    # reopen the segment and have its end forced), the steps run ahead
    assert engine.overlap.outcomes["ahead"] >= 20 and engine.overlap.outcomes["not_plain"] >= 10


def test_the_engine_tells_speculation_whether_its_steps_run_ahead() -> None:
    """`auto` bounds its drafting steps only where steps do run ahead (engine/spec/policy.py)."""
    ahead = make_engine(True, speculative_decoding="auto")
    plain = make_engine(False, speculative_decoding="auto")
    assert ahead.overlap is not None and ahead.speculation.config.overlapped
    assert plain.overlap is None and not plain.speculation.config.overlapped
    for engine in (ahead, plain):
        engine.close()
