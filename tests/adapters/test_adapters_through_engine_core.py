"""Adapter changes reach an engine core through the multi-process client, as they do in-process: attach (the
source crosses as its codec's text, the core opens it), in-use, evict and detach; an adapter's request answers
exactly as on an engine built serving the same folders."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import greedy, make_engine, run_all
from loraplex.adapters.base_model import BaseModelSpec
from loraplex.adapters.source import FolderAdapterSource
from loraplex.engine.config import AdapterLimits, EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.mp_client import MultiProcessEngineClient
from loraplex.engine.core.zmq_core_transport import ZmqCoreTransport
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest
from random_adapters import write_random_adapter
from train_adapters import chat_prompt_ids
from transformers import AutoTokenizer
from waiting import async_wait_until

pytestmark = pytest.mark.timeout(600)
LIMITS = AdapterLimits(max_loras=2, max_cpu_loras=16, max_lora_rank=64)


class FolderSourceCodec:
    """A folder source as JSON of its folders; the base model's spec and the dtype are the core's own."""

    def __init__(self, spec: BaseModelSpec) -> None:
        self.spec = spec

    def encode(self, source: Any) -> str:  # a FolderAdapterSource
        return json.dumps({adapter_id: str(folder) for adapter_id, folder in source.folders.items()})

    def decode(self, text: str) -> FolderAdapterSource:
        return FolderAdapterSource({k: Path(v) for k, v in json.loads(text).items()}, self.spec, torch.float32)


def _requests(prompt: list[int]) -> list[EngineRequest]:
    return [EngineRequest("adapted", prompt, greedy(8), adapter_id="good"), EngineRequest("base", prompt, greedy(8))]


async def test_attach_in_use_evict_and_detach_through_the_multi_process_client(ours, smollm_dir, smollm_spec,
                                                                               tmp_path):  # type: ignore[no-untyped-def]
    model, config = ours
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    # strong enough to change a greedy answer
    folders = {"good": write_random_adapter(tmp_path / "good", smollm_spec, r=16, targets=("v_proj", "o_proj"),
                                            seed=3, b_scale=1.0)}
    prompt = chat_prompt_ids(tokenizer, "Name a fruit.")
    reference, _ = make_engine(model, config, tokenizer, folders, smollm_spec, max_loras=2)
    expected = run_all(reference, _requests(prompt))
    reference.close()
    assert expected["adapted"].token_ids != expected["base"].token_ids  # the adapter changes the answer

    # The core's engine serves no adapters until a client attaches a source.
    engine = LLMEngine(model, config, EngineConfig(num_blocks=256, max_num_seqs=32, max_num_batched_tokens=512,
                                                   max_model_len=512, dtype="float32", device="cpu"),
                       AutoTokenizer.from_pretrained(smollm_dir), detokenize=False)
    codec = FolderSourceCodec(smollm_spec)
    address = f"ipc://{tempfile.mkdtemp()}/core.sock"
    core = EngineCore(engine, ZmqCoreTransport(address), adapter_codec=codec)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    client = await MultiProcessEngineClient.connect(address, tokenizer=tokenizer, model_config=config,
                                                    adapter_codec=codec, timeout_s=30)
    try:
        handle = client.attach_adapters(FolderAdapterSource(folders, smollm_spec, torch.float32), LIMITS)

        async def tokens(request: EngineRequest) -> list[int]:
            return [t async for out in client.generate(request) for c in out.choices for t in c.token_ids]

        got = await asyncio.wait_for(asyncio.gather(*(tokens(r) for r in _requests(prompt))), 120)
        assert got == [expected["adapted"].token_ids, expected["base"].token_ids]
        lora = engine.lora
        assert lora is not None and "good" in lora.resident_adapter_ids

        assert not await asyncio.to_thread(client.adapter_in_use, "good")
        await asyncio.to_thread(client.evict_adapter, "good")
        assert lora.host.get("good") is None  # the host copy goes at once

        client.detach_adapters(handle)
        await async_wait_until(lambda: engine.lora is None, timeout_s=10, what="the core to stop serving adapters")
    finally:
        client.stop_core()
        await async_wait_until(lambda: not thread.is_alive(), timeout_s=30, what="the engine core to stop")
        client.shutdown()
