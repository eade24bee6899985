"""Where a rank's model shard comes from: every worker process builds its own from a source.

A source is small and picklable (a path, or a config and a seed), so it can be sent to the
worker processes; `build` returns the rank's shard of the model on the rank's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from loraplex.engine.config import ModelConfig
from loraplex.engine.model.llama import LlamaForCausalLM
from loraplex.engine.parallel.group import TensorParallelGroup


class ModelSource(Protocol):
    def model_config(self) -> ModelConfig: ...

    def build(self, max_model_len: int, dtype: torch.dtype, device: str, tp: TensorParallelGroup
              ) -> LlamaForCausalLM: ...


@dataclass(frozen=True, slots=True)
class PathModelSource:
    """A local Hugging Face folder; each rank reads only its slices of every tensor."""

    path: str

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_pretrained(Path(self.path))

    def build(self, max_model_len: int, dtype: torch.dtype, device: str, tp: TensorParallelGroup
              ) -> LlamaForCausalLM:
        from loraplex.engine.model.loader import load_model

        return load_model(self.path, max_model_len, dtype, device, tp=tp)


@dataclass(frozen=True, slots=True)
class RandomModelSource:
    """Random weights. `whole=True`: the whole model is drawn on the host from `seed` and each
    rank keeps its shard, so every tensor-parallel size holds the same weights (tests);
    `whole=False`: each rank draws its shard on its device (real-size benchmarks: a 70B model
    fits no host and no single GPU). `lm_head_scale` sharpens the logits (no greedy ties)."""

    config: ModelConfig
    seed: int = 0
    whole: bool = True
    lm_head_scale: float = 1.0

    def model_config(self) -> ModelConfig:
        return self.config

    def build(self, max_model_len: int, dtype: torch.dtype, device: str, tp: TensorParallelGroup
              ) -> LlamaForCausalLM:
        if self.whole:
            from loraplex.engine.model.loader import random_model

            model = random_model(self.config, max_model_len, self.seed, dtype, device, tp=tp)
        else:
            from loraplex.engine.cuda.random_weights import random_device_model

            model = random_device_model(self.config, max_model_len, device=device, dtype=dtype,
                                        seed=self.seed * 1009 + tp.rank, tp=tp)
        if self.lm_head_scale != 1.0:
            with torch.no_grad():
                model.lm_head.weight.mul_(self.lm_head_scale)
        return model
