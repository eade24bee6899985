"""Requests for an adapter that cannot load fail (never wait forever); waiting for a load never busy-spins."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from engine_helpers import GatedSource, drain, greedy, make_engine
from loraplex.adapters.source import FolderAdapterSource
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.interfaces import AdapterWeights
from loraplex.engine.protocol import EngineRequest, FinishReason
from random_adapters import write_random_adapter
from train_adapters import chat_prompt_ids
from transformers import AutoTokenizer
from waiting import async_wait_until

pytestmark = pytest.mark.timeout(300)
IDLE_STEPS = 50


class BrokenSource:
    """Loads `good` adapters from folders; reading any other id fails like a corrupt or vanished blob."""

    def __init__(self, inner: FolderAdapterSource) -> None:
        self.inner = inner

    def load(self, adapter_id: str) -> AdapterWeights:
        if adapter_id in self.inner.folders:
            return self.inner.load(adapter_id)
        raise OSError(f"blob for {adapter_id} is unreadable")


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm_spec):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("load-failures")
    return {"good": write_random_adapter(root / "good", smollm_spec, r=4, targets=("q_proj",), seed=1)}


def test_unloadable_adapter_fails_its_requests_and_frees_everything(ours, tokenizer, folders, smollm_spec):
    model, config = ours
    source = BrokenSource(FolderAdapterSource(folders, smollm_spec, torch.float32))
    engine, manager = make_engine(model, config, tokenizer, folders, smollm_spec, max_loras=2, source=source)
    manager.host.retry_base_s = 60.0  # OSError is transient: keep it for this test (retries: test_adapter_load_retry)
    prompt = chat_prompt_ids(tokenizer, "Name a fruit.")
    requests = [EngineRequest("broken-1", prompt, greedy(4), adapter_id="broken"),
                EngineRequest("broken-n2", prompt, dataclasses.replace(greedy(4), n=2), adapter_id="broken"),
                EngineRequest("good", prompt, greedy(4), adapter_id="good"),
                EngineRequest("base", prompt, greedy(4))]
    for request in requests:
        engine.add_request(request)
    results = drain(engine, timeout_s=60)

    for request_id in ("broken-1", "broken-n2"):
        assert results[request_id].error is not None, request_id
        assert "blob for broken is unreadable" in results[request_id].error
        assert results[request_id].token_ids == []
    for request_id in ("good", "base"):
        assert results[request_id].error is None and len(results[request_id].token_ids) == 4
    assert manager.load_error("broken") is not None and not manager.is_in_use("broken")
    stats = engine.stats()
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # nothing held by the failed requests

    # A later request for the same adapter fails at once, with the same reason.
    engine.add_request(EngineRequest("broken-again", prompt, greedy(4), adapter_id="broken"))
    out = engine.step()
    assert [o.request_id for o in out] == ["broken-again"] and out[0].finished
    assert out[0].choices[0].finish_reason == FinishReason.ERROR
    assert "unreadable" in out[0].error
    manager.shutdown()


def test_engine_loop_sleeps_while_only_adapter_loads_wait(ours, tokenizer, folders, smollm_spec):
    model, config = ours
    source = GatedSource(FolderAdapterSource(folders, smollm_spec, torch.float32), {"good"})
    llm, manager = make_engine(model, config, tokenizer, folders, smollm_spec, max_loras=2, source=source,
                               detokenize=False)
    engine = AsyncEngine(llm)
    prompt = chat_prompt_ids(tokenizer, "Name a fruit.")

    async def scenario() -> tuple[float, list]:
        async def collect() -> list:
            return [o async for o in engine.generate(EngineRequest("slow", prompt, greedy(4), adapter_id="good"))]

        task = asyncio.create_task(collect())
        await async_wait_until(lambda: manager.host.is_loading("good"), timeout_s=10,
                               what="the request to queue and its adapter load to start")
        # The window is a number of engine steps, each with nothing to run: only the gated load is pending.
        first_step = llm.scheduler.num_steps
        cpu_before, wall_before = time.process_time(), time.monotonic()
        await async_wait_until(lambda: llm.scheduler.num_steps >= first_step + IDLE_STEPS, timeout_s=60,
                               what=f"{IDLE_STEPS} idle engine steps")
        wall = time.monotonic() - wall_before
        cpu = (time.process_time() - cpu_before) / wall
        # a loop that spins runs an idle step in microseconds; one that waits for news takes milliseconds
        assert wall / IDLE_STEPS > 0.001, f"{IDLE_STEPS} idle steps in {wall:.4f} s: the engine loop spins"
        assert not task.done()
        source.gate.set()
        started = time.monotonic()
        outputs = await asyncio.wait_for(task, 60)
        return cpu, [outputs, time.monotonic() - started]

    try:
        cpu_per_s, (outputs, after_load_s) = asyncio.run(scenario())
    finally:
        engine.shutdown()
        manager.shutdown()
    print(f"process CPU while waiting for the adapter: {cpu_per_s:.3f} s/s; first answer {after_load_s:.3f}s after load")
    assert cpu_per_s < 0.3, cpu_per_s
    assert outputs[-1].finished and outputs[-1].error is None
    assert sum(len(c.token_ids) for o in outputs for c in o.choices) == 4
