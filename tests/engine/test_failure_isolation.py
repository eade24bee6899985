"""A request that makes the step fail fails alone; its batch mates finish with the tokens of a clean run.

The poison is a sampling value the edge refuses, set after validation so that it reaches the sampler: a
temperature past what a float holds, which raises inside the batched draw when its tensor is built (a `top_k`
past int64 once did; the sampler now takes any k at or past the vocabulary as no top-k).
"""

from __future__ import annotations

from enginecore_helpers import greedy, output_tokens, run_to_completion
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, FinishReason, RequestOutput, SamplingParams


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)


def run_with_poison(engine: LLMEngine, poisons: list[EngineRequest], victims: list[EngineRequest],
                    temperature: int = 2**1024) -> dict[str, list[RequestOutput]]:
    """Everything in one engine; each poison's temperature is set past what a float holds after it was validated."""
    for request in poisons:
        engine.add_request(request)
        request.sampling.temperature = temperature
    for request in victims:
        engine.add_request(request)
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in poisons + victims}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs[out.request_id].append(out)
    raise AssertionError("engine did not finish")


def clean_run(smol, chat_prompt_ids) -> dict[str, list[int]]:
    engine = smol.engine()
    outputs = run_to_completion(engine, [
        EngineRequest("greedy", chat_prompt_ids[0], greedy(12, ignore_eos=True), tenant_id="victim"),
        EngineRequest("seeded", chat_prompt_ids[1], seeded(12, 7), tenant_id="victim"),
    ])
    return {rid: output_tokens(outs) for rid, outs in outputs.items()}


def test_a_poisoned_row_fails_alone_and_the_others_are_unchanged(smol, chat_prompt_ids):
    expected = clean_run(smol, chat_prompt_ids)
    engine = smol.engine()
    outputs = run_with_poison(engine, [EngineRequest("poison", chat_prompt_ids[2], seeded(12, 3), tenant_id="attacker")], [
        EngineRequest("greedy", chat_prompt_ids[0], greedy(12, ignore_eos=True), tenant_id="victim"),
        EngineRequest("seeded", chat_prompt_ids[1], seeded(12, 7), tenant_id="victim"),
    ])
    poison = outputs.pop("poison")
    assert poison[-1].finished and poison[-1].error and "Overflow" in poison[-1].error
    assert poison[-1].choices[0].finish_reason == FinishReason.ERROR
    assert {rid: output_tokens(outs) for rid, outs in outputs.items()} == expected
    assert all(out.error is None for outs in outputs.values() for out in outs)
    assert outputs["greedy"][-1].choices[0].finish_reason == FinishReason.LENGTH
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_two_culprits_among_many_are_each_found(smol, chat_prompt_ids):
    expected = {f"v{i}": output_tokens(run_to_completion(smol.engine(), [
        EngineRequest(f"v{i}", chat_prompt_ids[i], greedy(6, ignore_eos=True))])[f"v{i}"]) for i in range(4)}
    poisons = [EngineRequest(name, prompt, seeded(6, 1), tenant_id="attacker")
               for name, prompt in (("p0", chat_prompt_ids[5]), ("p1", chat_prompt_ids[6]))]
    victims = [EngineRequest(f"v{i}", chat_prompt_ids[i], greedy(6, ignore_eos=True)) for i in range(4)]
    outputs = run_with_poison(smol.engine(), poisons, victims)
    for name in ("p0", "p1"):
        assert outputs.pop(name)[-1].choices[0].finish_reason == FinishReason.ERROR
    assert {rid: output_tokens(outs) for rid, outs in outputs.items()} == expected
