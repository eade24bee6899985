"""AsyncEngine: streaming, typed errors before queueing, abort frees blocks, failure isolation, sessions."""

from __future__ import annotations

import asyncio
import random

import pytest
from enginecore_helpers import tiny_random_config
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from loraplex.engine.protocol import EngineRequest, FinishReason, SamplingParams
from waiting import async_wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tiny_engine(smol):
    engine = AsyncEngine.from_random(
        tiny_random_config(), EngineConfig(num_blocks=256, max_model_len=512, max_num_seqs=64), smol.tokenizer
    )
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, request: EngineRequest) -> list:
    return [out async for out in engine.generate(request)]


async def wait_idle(engine: AsyncEngine, *, keeps_pins: bool = False) -> dict:
    """The engine's stats once nothing runs or waits and no block is held (`keeps_pins`: but sessions' pins)."""
    def idle_stats() -> dict | None:
        stats = engine.stats()
        held = stats["num_blocks_pinned"] if keeps_pins else 0
        return stats if stats["num_running"] == stats["num_waiting"] == 0 and stats["num_blocks_used"] == held else None

    return await async_wait_until(idle_stats, timeout_s=10, what=lambda: f"an idle engine: {engine.stats()}")


async def test_generate_streams_deltas_that_add_up(smollm_engine, chat_prompt_ids):
    outputs = await collect(smollm_engine, EngineRequest("stream", chat_prompt_ids[2], SamplingParams(
        max_tokens=16, temperature=0)))
    assert len(outputs) > 1 and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    tokens = [t for o in outputs for c in o.choices for t in c.token_ids]
    text = "".join(c.text for o in outputs for c in o.choices)
    assert text == smollm_engine.tokenizer.decode(tokens, skip_special_tokens=True)
    last = outputs[-1]
    assert last.num_prompt_tokens == len(chat_prompt_ids[2])
    assert last.choices[0].num_output_tokens == len(tokens) == 16
    assert last.choices[0].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(("prompt", "params", "error", "param"), [
    ([1, 2], SamplingParams(max_tokens=0), InvalidRequestError, "max_tokens"),
    ([1, 2], SamplingParams(temperature=-0.5), InvalidRequestError, "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), InvalidRequestError, "top_p"),
    ([1, 2], SamplingParams(top_p=1.5), InvalidRequestError, "top_p"),
    ([], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, 49152], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, -3], SamplingParams(), InvalidRequestError, "prompt"),
    ([1] * 500, SamplingParams(max_tokens=100), PromptTooLongError, "max_tokens"),
    ([1] * 10, SamplingParams(max_tokens=100, n=64), PromptTooLongError, "max_tokens"),
    ([1] * 10, SamplingParams(max_tokens=10, n=65), InvalidRequestError, "n"),  # over max_num_seqs
])
async def test_bad_input_raises_a_typed_error_at_once(tiny_engine, prompt, params, error, param):
    with pytest.raises(error) as caught:
        await asyncio.wait_for(collect(tiny_engine, EngineRequest("bad", prompt, params)), timeout=5)
    assert caught.value.param == param
    assert (await wait_idle(tiny_engine))["num_running"] == 0


async def test_duplicate_request_id_is_refused(tiny_engine):
    stream = tiny_engine.generate(EngineRequest("dup", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True)))
    first = await stream.__anext__()
    with pytest.raises(DuplicateRequestError):
        await collect(tiny_engine, EngineRequest("dup", [5, 6], SamplingParams()))
    rest = [o async for o in stream]
    assert (rest or [first])[-1].finished


async def test_stopping_iteration_aborts_and_frees_every_block(tiny_engine):
    request = EngineRequest("walkaway", list(range(10, 200)), SamplingParams(max_tokens=300, ignore_eos=True))
    async for _ in tiny_engine.generate(request):
        break
    stats = await wait_idle(tiny_engine)
    assert stats["num_blocks_used"] == 0 and stats["num_running"] == 0


async def test_explicit_abort_ends_the_stream_with_abort(tiny_engine):
    request = EngineRequest("aborted", list(range(10, 60)), SamplingParams(max_tokens=300, ignore_eos=True))
    outputs = []
    async for out in tiny_engine.generate(request):
        outputs.append(out)
        if len(outputs) == 2:
            tiny_engine.abort("aborted")
    assert outputs[-1].finished and outputs[-1].choices[0].finish_reason == FinishReason.ABORT
    assert (await wait_idle(tiny_engine))["num_blocks_used"] == 0


class ExplodingGrammar:
    """A grammar whose matcher fails on its third token (a bug in one request's grammar)."""

    def new_matcher(self) -> ExplodingMatcher:
        return ExplodingMatcher()


class ExplodingMatcher:
    def __init__(self) -> None:
        self.count = 0

    def accept_token(self, token_id: int) -> bool:
        self.count += 1
        if self.count == 3:
            raise RuntimeError("matcher bug")
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        return None

    def is_terminated(self) -> bool:
        return False


async def test_one_request_failing_does_not_stop_the_others(tiny_engine):
    healthy = EngineRequest("healthy", [3, 4, 5, 6], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    broken = EngineRequest("broken", [3, 4, 5, 6], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                           grammar=ExplodingGrammar())
    good, bad = await asyncio.gather(collect(tiny_engine, healthy), collect(tiny_engine, broken))
    assert bad[-1].finished and bad[-1].choices[0].finish_reason == FinishReason.ERROR
    assert "matcher bug" in bad[-1].error
    assert good[-1].choices[0].finish_reason == FinishReason.LENGTH
    assert sum(len(c.token_ids) for o in good for c in o.choices) == 12
    assert (await wait_idle(tiny_engine))["num_blocks_used"] == 0


async def test_thousand_mixed_requests_return_every_block(smol):
    engine = AsyncEngine.from_random(
        tiny_random_config(num_hidden_layers=1),
        EngineConfig(num_blocks=96, max_model_len=256, max_num_seqs=48, max_num_batched_tokens=256),
        smol.tokenizer,
    )
    rng = random.Random(0)
    finish_reasons: dict[str, int] = {}

    async def one(i: int) -> None:
        kind = i % 5
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 60))]
        params = SamplingParams(max_tokens=rng.randrange(1, 24), temperature=rng.choice([0.0, 0.8]),
                                seed=i, n=1 + (i % 7 == 0))
        grammar = None
        if kind == 1:
            params.stop_token_ids = list(range(3, 49152, 7))  # most tokens stop
        elif kind == 2:
            grammar = ExplodingGrammar()
        elif kind == 3:
            params.stop = ["e", "a", " "]
        request = EngineRequest(f"m{i}", prompt, params, tenant_id=f"t{i % 3}", grammar=grammar,
                                session_id=f"s{i}" if i % 11 == 0 else None)
        received = 0
        async for out in engine.generate(request):
            received += 1
            if kind == 4 and received == 2:
                break  # the consumer walks away: an abort
            for c in out.choices:
                if c.finish_reason:
                    finish_reasons[c.finish_reason] = finish_reasons.get(c.finish_reason, 0) + 1

    try:
        for start in range(0, 1000, 100):
            await asyncio.gather(*(one(i) for i in range(start, start + 100)))
        stats = await wait_idle(engine, keeps_pins=True)
        assert stats["num_blocks_pinned"] > 0
        for i in range(0, 1000, 11):
            engine.release_session(f"s{i}")
        stats = await wait_idle(engine)
        assert stats["num_blocks_pinned"] == 0
        assert stats["num_blocks_free"] == stats["num_blocks_total"] == 96
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert {"stop", "length", "error"} <= set(finish_reasons)
        assert engine.engine.requests == {}
    finally:
        engine.shutdown()


async def test_session_pin_makes_the_next_turn_a_cache_hit(smollm_engine, chat_prompt_ids):
    # the engine is shared with other test folders, whose sessions may still hold pins
    pinned_before = smollm_engine.stats()["num_blocks_pinned"]
    turn1 = EngineRequest("turn1", chat_prompt_ids[4], SamplingParams(max_tokens=20, temperature=0),
                          session_id="sess-1", tenant_id="tenant-s")
    out1 = await collect(smollm_engine, turn1)
    generated = [t for o in out1 for c in o.choices for t in c.token_ids]
    assert smollm_engine.stats()["num_blocks_pinned"] > pinned_before
    history = chat_prompt_ids[4] + generated
    turn2 = EngineRequest("turn2", [*history, 198, 1, 4093, 198], SamplingParams(max_tokens=4, temperature=0),
                          session_id="sess-1", tenant_id="tenant-s")
    out2 = await collect(smollm_engine, turn2)
    assert out2[-1].num_cached_tokens == (len(history) - 1) // 16 * 16
    smollm_engine.release_session("sess-1")
    await async_wait_until(lambda: smollm_engine.stats()["num_blocks_pinned"] <= pinned_before, timeout_s=10,
                           what="the released session's blocks to be unpinned")


async def test_shutdown_ends_open_streams_and_refuses_new_work(smol):
    from loraplex.engine.errors import EngineDeadError

    engine = AsyncEngine.from_random(tiny_random_config(num_hidden_layers=1),
                                     EngineConfig(num_blocks=64, max_model_len=512), smol.tokenizer)
    stream = engine.generate(EngineRequest("open", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)))
    await stream.__anext__()
    await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
    rest = [out async for out in stream]
    assert rest[-1].finished and rest[-1].choices[-1].finish_reason == FinishReason.ABORT
    with pytest.raises(EngineDeadError):
        await collect(engine, EngineRequest("late", [5, 6], SamplingParams()))
