"""The caller's side of outputs (engine.output.text): text from token ids, stop strings, merged deltas.

The engine loop sends token ids only; whoever reads the outputs (an API server, the in-process client)
makes the text, and a stop string ends the request there: later tokens are never delivered or counted.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from enginecore_helpers import greedy, output_text, output_tokens, run_to_completion
from loraplex.engine.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.output.text import OutputStream, RequestText, merge
from loraplex.engine.protocol import ChoiceDelta, EngineRequest, FinishReason, RequestOutput
from waiting import async_wait_until

pytestmark = pytest.mark.timeout(300)


def _output(request_id: str, token_ids: list[int], count: int, finish: str | None = None, **kw) -> RequestOutput:  # type: ignore[no-untyped-def]
    delta = ChoiceDelta(0, token_ids=list(token_ids), num_output_tokens=count, finish_reason=finish, **kw)
    return RequestOutput(request_id, [delta], finish is not None, 3, 0)


def test_a_stop_string_inside_a_multi_token_delta_drops_the_tokens_after_it(smol):
    tok = smol.tokenizer
    ids = tok.encode(" one two three four five", add_special_tokens=False)
    text = RequestText(EngineRequest("r", [1, 2, 3], greedy(50, stop=[" three"])), tok)
    first = text.process(_output("r", ids[:1], 1))
    assert first is not None and first.choices[0].text == " one" and not first.finished
    rest = text.process(_output("r", ids[1:], len(ids)))  # jump-forward or merged steps: several tokens
    assert rest is not None and rest.finished and text.stopped_early
    delta = rest.choices[0]
    assert delta.text == " two" and delta.finish_reason == FinishReason.STOP and delta.stop_reason == " three"
    kept = ids.index(tok.encode(" three", add_special_tokens=False)[0]) + 1
    assert delta.token_ids == ids[1:kept] and delta.num_output_tokens == kept  # billed: what was delivered
    assert text.kept_token_counts() == [kept]  # what the engine is told, so it counts the rest as discarded
    assert text.process(_output("r", ids[:1], len(ids) + 1)) is None  # anything later is dropped


def test_eos_has_no_text_and_a_kept_stop_token_has_its_text(smol):
    tok = smol.tokenizer
    ids = tok.encode(" hello", add_special_tokens=False)
    eos = RequestText(EngineRequest("e", [1], greedy(9)), tok)
    out = eos.process(_output("e", [*ids, tok.eos_token_id], len(ids) + 1, FinishReason.STOP, hide_last_token=True))
    assert out is not None and out.choices[0].text == " hello" and out.finished and not eos.stopped_early
    kept = RequestText(EngineRequest("k", [1], greedy(9, stop_token_ids=[ids[-1]], include_stop_str_in_output=True)), tok)
    out = kept.process(_output("k", ids, len(ids), FinishReason.STOP, stop_reason=ids[-1]))
    assert out is not None and out.choices[0].text == " hello"


def test_queued_outputs_are_handed_over_as_one(smol):
    async def scenario() -> RequestOutput:
        tok = smol.tokenizer
        ids = tok.encode(" a b c d", add_special_tokens=False)
        stream = OutputStream(EngineRequest("m", [1], greedy(len(ids))), tok)
        for i, token in enumerate(ids):  # the engine side queued four steps while the reader was busy
            stream.queue.put_nowait(_output("m", [token], i + 1, FinishReason.LENGTH if i == len(ids) - 1 else None))
        return await stream.next()

    merged = asyncio.run(scenario())
    assert merged.finished and len(merged.choices) == 1
    delta = merged.choices[0]
    assert delta.text == " a b c d" and delta.num_output_tokens == len(delta.token_ids) == 4
    assert delta.finish_reason == FinishReason.LENGTH


def test_merge_keeps_the_first_prompt_logprobs_and_the_last_counts():
    first = _output("x", [5], 1)
    first.prompt_logprobs = [None]
    second = _output("x", [6, 7], 3, FinishReason.LENGTH)
    merged = merge([first, second])
    assert merged.prompt_logprobs == [None] and merged.finished
    assert merged.choices[0].token_ids == [5, 6, 7] and merged.choices[0].num_output_tokens == 3


def test_merging_many_outputs_is_linear_and_leaves_the_first_outputs_lists_alone():
    first = _output("x", [0], 1, text="t0", logprobs=["l0"])
    kept_ids, kept_logprobs = first.choices[0].token_ids, first.choices[0].logprobs
    steps = [first] + [_output("x", [i], i + 1, text=f"t{i}", logprobs=[f"l{i}"]) for i in range(1, 20_000)]
    started = time.perf_counter()
    merged = merge(steps)
    took = time.perf_counter() - started
    choice = merged.choices[0]
    assert choice.token_ids == list(range(20_000)) and choice.logprobs == [f"l{i}" for i in range(20_000)]
    assert choice.text == "".join(f"t{i}" for i in range(20_000)) and choice.num_output_tokens == 20_000
    assert kept_ids == [0] and kept_logprobs == ["l0"]  # the lists it started from were copied, not grown
    assert took < 0.5, f"merging 20,000 outputs took {took:.2f}s"  # quadratic: ~2 s of copies


def test_the_engine_loop_sends_token_ids_only_when_a_client_makes_the_text(smol, chat_prompt_ids):
    engine = LLMEngine(smol.model, smol.config, EngineConfig(kv_cache_bytes=32 << 20, max_model_len=2048),
                       smol.tokenizer, detokenize=False)
    out = run_to_completion(engine, [EngineRequest("raw", chat_prompt_ids[0], greedy(8))])["raw"]
    assert output_text(out) == "" and len(output_tokens(out)) == 8


async def test_a_stop_string_through_the_async_engine_stops_the_request_and_counts_what_was_sent(
        smollm_engine, chat_prompt_ids):
    prompt = chat_prompt_ids[1]
    full = [o async for o in smollm_engine.generate(EngineRequest("full-t", prompt, greedy(40)))]
    text = "".join(c.text for o in full for c in o.choices)
    stop = text.split()[3]
    before = smollm_engine.engine.stats()
    outs = [o async for o in smollm_engine.generate(EngineRequest(
        "stop-t", prompt, greedy(40, stop=[stop]), session_id="stop-session", tenant_id="t-stop"))]
    last = outs[-1].choices[-1]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason == stop
    delivered = [t for o in outs for c in o.choices for t in c.token_ids]
    assert last.num_output_tokens == len(delivered) < 40
    assert "".join(c.text for o in outs for c in o.choices) == text[: text.index(stop)]
    # the engine stopped it (not aborted): its blocks are free and its session pinned
    await async_wait_until(lambda: smollm_engine.engine.session_state("stop-session") == "pinned"
                           and "stop-t" not in smollm_engine.engine.requests, timeout_s=10,
                           what="the stopped request to end with its session pinned")
    assert "stop-t" not in smollm_engine.engine.requests
    assert smollm_engine.engine.session_state("stop-session") == "pinned"
    after = smollm_engine.engine.stats()
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    discarded = after["discarded_tokens_total"] - before["discarded_tokens_total"]
    assert generated - discarded == len(delivered)  # the engine's counts reconcile with what was billed
    smollm_engine.release_session("stop-session")


def test_a_whole_stream_holds_the_steps_and_hands_over_one_output_with_the_same_text(smol):
    """A non-streaming caller: no wake-up per step; one merged output whose text is what the steps make one
    by one, its first step's arrival kept for the time to first token; an error still comes after them."""
    tok = smol.tokenizer
    ids = tok.encode(" a whole answer, made into text once", add_special_tokens=False)
    steps = [_output("w", ids[:i + 1][-1:], i + 1) for i in range(len(ids) - 1)]
    steps.append(_output("w", ids[-1:], len(ids), FinishReason.LENGTH))

    async def read(whole: bool) -> tuple[list[RequestOutput], int]:
        stream = OutputStream(EngineRequest("w", [1, 2, 3], greedy(50)), tok, whole=whole)
        for step in steps[:-1]:
            stream.deliver(RequestOutput("w", [ChoiceDelta(0, token_ids=list(step.choices[0].token_ids),
                                                           num_output_tokens=step.choices[0].num_output_tokens)],
                                         False, 3, 0))
        queued = stream.queue.qsize()
        last = steps[-1]
        stream.deliver(RequestOutput("w", [ChoiceDelta(0, token_ids=list(last.choices[0].token_ids),
                                                       num_output_tokens=len(ids), finish_reason=FinishReason.LENGTH)],
                                     True, 3, 0))
        got = [await stream.next()]
        while not got[-1].finished:
            got.append(await stream.next())
        return got, queued

    whole, held_back = asyncio.run(read(True))
    steps_one_by_one, queued = asyncio.run(read(False))
    assert held_back == 0 and queued == len(ids) - 1
    assert len(whole) == 1 and whole[0].received_at is not None
    assert whole[0].choices[0].text == "".join(o.choices[0].text for o in steps_one_by_one) == tok.decode(ids)
    assert whole[0].choices[0].token_ids == ids and whole[0].choices[0].num_output_tokens == len(ids)
    assert whole[0].choices[0].finish_reason == FinishReason.LENGTH

    async def failed() -> None:
        stream = OutputStream(EngineRequest("f", [1], greedy(50)), tok, whole=True)
        stream.deliver(_output("f", ids[:2], 2))
        stream.fail(RuntimeError("engine gone"))
        first = await stream.next()
        assert first.choices[0].token_ids == ids[:2]
        with pytest.raises(RuntimeError, match="engine gone"):
            await stream.next()

    asyncio.run(failed())
    # Stop strings are matched as the text grows (to stop the engine early): such a stream is never whole.
    assert not OutputStream(EngineRequest("s", [1], greedy(50, stop=["x"])), tok, whole=True).whole
