"""AsyncEngine delivery: one loop wake-up per step for many streams, per-loop routing, abandoned tails."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from enginecore_helpers import tiny_random_config
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.protocol import EngineRequest, FinishReason, SamplingParams

pytestmark = pytest.mark.timeout(180)

STREAMS = 16
TOKENS = 8


class CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the engine thread's thread-safe wake-ups."""

    def __init__(self) -> None:
        super().__init__()
        self.threadsafe_calls = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(*args, **kwargs)


@pytest.fixture(scope="module")
def engine(smol):
    engine = AsyncEngine.from_random(tiny_random_config(num_hidden_layers=1),
                                     EngineConfig(num_blocks=256, max_model_len=512, max_num_seqs=64), smol.tokenizer)
    yield engine
    engine.shutdown()


def _requests(prefix: str) -> list[EngineRequest]:
    return [EngineRequest(f"{prefix}{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=TOKENS, ignore_eos=True))
            for i in range(STREAMS)]


async def _stream_all(engine: AsyncEngine, requests: list[EngineRequest]) -> dict[str, list]:
    async def one(request: EngineRequest) -> list:
        return [out async for out in engine.generate(request)]

    results = await asyncio.gather(*(one(r) for r in requests))
    return {r.request_id: outs for r, outs in zip(requests, results, strict=True)}


def _check_streams(results: dict[str, list]) -> None:
    for outs in results.values():
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert sum(len(c.token_ids) for o in outs for c in o.choices) == TOKENS


def test_a_step_wakes_the_loop_once_not_once_per_stream(engine):
    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        results = runner.run(_stream_all(engine, _requests("wake")))
        calls = runner.get_loop().threadsafe_calls
    _check_streams(results)
    outputs = sum(len(outs) for outs in results.values())
    # One wake-up per step: at most the steps the 16 requests need (they may straggle into the
    # batch over a few steps), fewer than the outputs (one wake-up each before batching).
    assert calls <= TOKENS + STREAMS < outputs, (calls, outputs)


def test_streams_on_two_loops_each_get_only_their_own_outputs(engine):
    results: dict[str, dict[str, list]] = {}

    def run(prefix: str) -> None:
        results[prefix] = asyncio.run(_stream_all(engine, _requests(prefix)))

    threads = [threading.Thread(target=run, args=(p,)) for p in ("left", "right")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(results) == {"left", "right"}
    for prefix, streams in results.items():
        assert all(o.request_id.startswith(prefix) for outs in streams.values() for o in outs)
        _check_streams(streams)


async def test_a_stream_stopped_early_leaves_its_tail_for_billing(engine):
    request = EngineRequest("gone", [9, 8, 7], SamplingParams(max_tokens=400, ignore_eos=True))
    stream = engine.generate(request)
    first = await stream.__anext__()
    await stream.aclose()  # the client went away: the request is aborted
    tail = await engine.take_abandoned_outputs("gone")
    assert tail and tail[-1].finished and tail[-1].choices[0].finish_reason == FinishReason.ABORT
    assert tail[-1].choices[0].num_output_tokens >= len(first.choices[0].token_ids)
    assert await engine.take_abandoned_outputs("gone") == []


async def _stop_string_a_few_tokens_in(engine: AsyncEngine, tokenizer: Any, prompt: list[int]) -> tuple[str, int]:
    """A stop string the tiny model is sure to meet greedily from `prompt` a few tokens in, and the token that
    completes it: the whole text of one output token (the 6th, or a later one where that will not do), so the match
    ends with that token whatever the model's text (its random weights write differently on other CPUs)."""
    outs = [o async for o in engine.generate(EngineRequest("probe", prompt, SamplingParams(
        max_tokens=12, ignore_eos=True, temperature=0)))]
    ids = [t for o in outs for t in o.choices[0].token_ids]
    text = tokenizer.decode(ids)
    for position in range(6, len(ids) + 1):
        start = len(tokenizer.decode(ids[: position - 1]))
        stop = tokenizer.decode(ids[:position])[start:]
        if stop.strip() and stop.isascii() and text.index(stop) == start:
            return stop, position
    raise AssertionError(f"no usable stop string in {text!r}")


async def _until_idle(engine: AsyncEngine, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while engine.engine.stats()["num_running"] and loop.time() < deadline:
        await asyncio.sleep(0.01)


async def test_a_stop_string_stops_the_engine_while_the_caller_is_not_reading(engine, smol):
    # A caller blocked on a slow client reads nothing for a while; the engine must stop at the stop string all
    # the same, not decode on to max_tokens (or until the send times out) on a slot others could use.
    prompt = [11, 12, 13]
    stop, completing = await _stop_string_a_few_tokens_in(engine, smol.tokenizer, prompt)
    before = engine.engine.stats()
    stream = engine.generate(EngineRequest("slow", prompt, SamplingParams(
        max_tokens=400, ignore_eos=True, temperature=0, stop=[stop])))
    first = await stream.__anext__()
    await _until_idle(engine)              # not reading: the outputs pile up, unread
    after = engine.engine.stats()
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 60, generated       # stopped near the stop string (~6 tokens in), far from 400
    rest = [first] + [o async for o in stream]
    text = "".join(o.choices[0].text for o in rest)
    final = rest[-1].choices[0]
    assert rest[-1].finished and final.finish_reason == FinishReason.STOP and final.stop_reason == stop
    assert stop not in text and len(text) > 0
    kept = final.num_output_tokens
    assert kept == completing
    assert after["discarded_tokens_total"] - before["discarded_tokens_total"] == generated - kept


async def test_a_caller_gone_after_a_stop_string_matched_unread_still_gets_the_kept_counts(engine, smol):
    prompt = [21, 22, 23]
    stop, completing = await _stop_string_a_few_tokens_in(engine, smol.tokenizer, prompt)
    stream = engine.generate(EngineRequest("left", prompt, SamplingParams(
        max_tokens=400, ignore_eos=True, temperature=0, stop=[stop])))
    first = await stream.__anext__()
    await _until_idle(engine)              # the stop string matched at hand-over; the caller never read it
    await stream.aclose()
    tail = await engine.take_abandoned_outputs("left")
    assert tail and tail[-1].finished and tail[-1].choices[0].finish_reason == FinishReason.STOP
    delivered = len(first.choices[0].token_ids) + sum(len(o.choices[0].token_ids) for o in tail)
    assert delivered == tail[-1].choices[0].num_output_tokens == completing
    assert await engine.take_abandoned_outputs("left") == []
