"""Drive an LLMEngine with LoRA on the CPU, and PEFT as the oracle, for the adapters tests."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loraplex.adapters.base_model import BaseModelSpec
from loraplex.adapters.source import FolderAdapterSource
from loraplex.engine.config import AdapterLimits, EngineConfig, ModelConfig
from loraplex.engine.interfaces import AdapterWeights
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, SamplingParams


@dataclass(slots=True)
class Finished:
    token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per generated token
    error: str | None = None
    finish_step: int = -1


def make_engine(model, model_config: ModelConfig, tokenizer, folders: dict[str, Path], spec: BaseModelSpec,  # type: ignore[no-untyped-def]
                *, max_loras: int, max_cpu_loras: int = 16, source=None, max_num_seqs: int = 32, detokenize: bool = True):
    config = EngineConfig(num_blocks=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                          max_model_len=512, dtype="float32", device="cpu")
    source = source or FolderAdapterSource(folders, spec, torch.float32)
    engine = LLMEngine(model, model_config, config, tokenizer, adapters=source, detokenize=detokenize,
                       adapter_limits=AdapterLimits(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=64))
    return engine, engine.lora


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=False)


def run_all(engine: LLMEngine, requests: list[EngineRequest], timeout_s: float = 300.0) -> dict[str, Finished]:
    for request in requests:
        engine.add_request(request)
    return drain(engine, timeout_s)


def drain(engine: LLMEngine, timeout_s: float = 300.0) -> dict[str, Finished]:
    """Step until every request finished; what each request produced."""
    results: dict[str, Finished] = {}
    deadline = time.monotonic() + timeout_s
    step = 0
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not finish")
        outputs = engine.step()
        step += 1
        if not outputs and engine.scheduler.num_running == 0:
            time.sleep(0.01)  # only requests whose adapter is still loading
        for out in outputs:
            done = results.setdefault(out.request_id, Finished())
            for choice in out.choices:
                done.token_ids.extend(choice.token_ids)
                for lp in choice.logprobs or []:
                    done.top_logprobs.append({tid: val for tid, val in lp.top})
            if out.error:
                done.error = out.error
            if out.finished:
                done.finish_step = step
    return results


class GatedSource:
    """An AdapterSource whose loads of `gated` adapters wait for `gate` (a slow disk or object store)."""

    def __init__(self, inner: FolderAdapterSource, gated: set[str]) -> None:
        self.inner = inner
        self.gated = gated
        self.gate = threading.Event()

    def load(self, adapter_id: str) -> AdapterWeights:
        if adapter_id in self.gated:
            self.gate.wait(timeout=120)
        return self.inner.load(adapter_id)
