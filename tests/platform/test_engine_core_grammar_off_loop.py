"""The engine core never compiles a grammar on its loop: a request whose grammar is still compiling waits
off the loop while other requests keep stepping, and joins the engine once its grammar is ready."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path

import pytest
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.mp_client import MultiProcessEngineClient
from loraplex.engine.core.zmq_core_transport import ZmqCoreTransport
from loraplex.engine.interfaces import CompiledGrammar
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, FinishReason, ReasoningMarkers, SamplingParams
from loraplex.grammar.compiler import GrammarCompilerService
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from loraplex.platform.grammar_wire import SpecGrammarCodec
from waiting import async_wait_until

pytestmark = pytest.mark.timeout(300)


class GatedCodec(SpecGrammarCodec):
    """The real codec, whose compile (a cache miss in the core) finishes only when the test opens the gate."""

    def __init__(self, compiler: GrammarCompilerService) -> None:
        super().__init__(compiler)
        self.gate = threading.Event()
        self.num_compiles_started = 0

    def decode(self, text: str, reasoning: ReasoningMarkers | None) -> CompiledGrammar:
        self.num_compiles_started += 1
        self.gate.wait(60)
        return super().decode(text, reasoning)


async def test_a_compiling_grammar_does_not_hold_up_other_requests(smollm_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    model_config = ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "eos_token_id": 2})
    engine = LLMEngine.from_random(model_config, EngineConfig(num_blocks=128, max_model_len=512), tokenizer,
                                   detokenize=False)
    compiler = GrammarCompilerService(tokenizer, model_config.vocab_size)
    codec = GatedCodec(compiler)
    address = f"ipc://{tempfile.mkdtemp()}/core.sock"
    core = EngineCore(engine, ZmqCoreTransport(address), grammar_codec=codec)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    client = await MultiProcessEngineClient.connect(address, tokenizer=tokenizer, model_config=model_config,
                                                    grammar_codec=SpecGrammarCodec(), timeout_s=30)
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))

        async def run(request: EngineRequest) -> list:
            return [out async for out in client.generate(request)]

        constrained = asyncio.create_task(run(EngineRequest("json", [1, 2, 3], SamplingParams(
            max_tokens=30, temperature=0), grammar=grammar)))
        plain = await asyncio.wait_for(run(EngineRequest("plain", [1, 2, 3], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True))), 60)
        assert plain[-1].finished and plain[-1].choices[-1].num_output_tokens == 8
        assert not constrained.done()  # its grammar is still compiling: it waits, the loop does not
        codec.gate.set()
        outs = await asyncio.wait_for(constrained, 60)
        assert outs[-1].finished and outs[-1].error is None
        assert outs[-1].choices[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)

        codec.gate.clear()  # aborted while compiling: it ends at once with an abort, nothing hangs
        pending = [client.generate(EngineRequest("json-2", [4, 5, 6], SamplingParams(max_tokens=30),
                                                 grammar=grammar))]
        first = asyncio.create_task(anext(pending[0]))
        await async_wait_until(lambda: codec.num_compiles_started == 2, timeout_s=30,
                               what="the second grammar to start compiling in the core")
        client.abort("json-2")
        final = await asyncio.wait_for(first, 10)
        assert final.finished and final.choices == []
        codec.gate.set()
    finally:
        codec.gate.set()
        client.stop_core()
        await async_wait_until(lambda: not thread.is_alive(), timeout_s=30, what="the engine core to stop")
        client.shutdown()
        compiler.close()
