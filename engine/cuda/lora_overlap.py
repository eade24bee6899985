"""LoRA deltas on a side stream, beside the base GEMM they belong to (CUDA runner, one rank).

A decode step's LoRA kernels are latency-bound: each adapted linear's shrink -> expand chain
costs ~10 µs on the H100 against ~1-5 µs of bytes, and it ran after the base GEMM, on the
critical path. Both depend only on the linear's input x, so the runner's LoRA batch forks a
side stream at the linear (`begin`), launches the LoRA work there while the main stream runs
the base GEMM, and joins before the output is used (`finish`). Two modes:

- "delta": the side stream computes the whole delta into a zeroed buffer D (the fused
  shrink+expand kernel); the main stream adds D into y after the join (one elementwise launch
  in place of the chain);
- "shrink": only the shrink runs on the side stream; the expand (two-launch mode, no counters)
  runs on the main stream after the join, adding into y directly.

Under a CUDA graph capture the fork and join become graph edges, so replays overlap the same
way. Tensor-parallel ranks keep the plain `apply` (their row-parallel deltas must be added
before the all-reduce, inside the linear).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from loraplex.engine.context import LoRAStepContext
from loraplex.engine.kernels import lora_triton
from loraplex.engine.kernels.lora_metadata import LoRAMetadata
from loraplex.engine.kernels.lora_weights import LoRAStack
from loraplex.engine.lora.slot_pool import EVERY_LINEAR, StackKey
from loraplex.engine.lora.step import AddLoRA, KernelLoRABatch

Slices = tuple[tuple[str, int, int], ...]


@dataclass(slots=True)
class PendingDelta:
    stream: torch.cuda.Stream
    delta: torch.Tensor | None = None          # "delta" mode
    expand: Callable[[torch.Tensor], None] | None = None  # "shrink" mode: launches the expand into y

    def finish(self, y: torch.Tensor) -> None:
        torch.cuda.current_stream(y.device).wait_stream(self.stream)
        if self.delta is not None:
            y.add_(self.delta)
        elif self.expand is not None:
            self.expand(y)


@dataclass(slots=True)
class SideStreamLoRABatch:
    """The CUDA kernels' LoRA batch (`KernelLoRABatch`'s fields) with `begin` for the overlap."""

    meta: LoRAMetadata
    stacks: dict[StackKey, LoRAStack]
    add_lora: AddLoRA
    stream: torch.cuda.Stream
    mode: str = "delta"
    signature: str = EVERY_LINEAR  # which linears `stacks` covers (`KernelLoRABatch.signature`)

    @classmethod
    def wrap(cls, batch: LoRAStepContext | None, stream: torch.cuda.Stream,
             mode: str) -> LoRAStepContext | None:
        """`batch` if it is not a kernel LoRA batch, else its side-stream twin."""
        if not isinstance(batch, KernelLoRABatch):
            return batch
        return cls(batch.meta, batch.stacks, batch.add_lora, stream, mode, batch.signature)

    def apply(self, x: torch.Tensor, y: torch.Tensor, layer_index: int, slices: Slices) -> None:
        stack = self.stacks.get((layer_index, slices))
        if stack is not None:
            self.add_lora(y, x, stack, self.meta)

    def begin(self, x: torch.Tensor, layer_index: int, slices: Slices, out_features: int) -> PendingDelta | None:
        stack = self.stacks.get((layer_index, slices))
        if stack is None:
            return None
        main = torch.cuda.current_stream(x.device)
        self.stream.wait_stream(main)
        if self.mode == "delta":
            delta = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)  # on main: no kernel
            with torch.cuda.stream(self.stream):
                delta.zero_()
                self.add_lora(delta, x, stack, self.meta)
            return PendingDelta(self.stream, delta=delta)
        config = dataclasses.replace(lora_triton.choose_config(stack, self.meta), fused=False)
        partials = lora_triton._partials(stack, self.meta, config, x.device)
        launch = partial(lora_triton._launch, mid=partials, stack=stack, meta=self.meta, config=config,
                         token_io=False)
        with torch.cuda.stream(self.stream):
            launch(x=x, y=None, do_shrink=True, do_expand=False)

        def expand(y: torch.Tensor) -> None:
            launch(x=None, y=y, do_shrink=False, do_expand=True)

        return PendingDelta(self.stream, expand=expand)
