"""The per-step LoRA context the model's LoRA-ready linears call.

Built once per step and shared by every layer: `apply(x, y, layer_index,
slices)` adds each slice's delta into `y` in place. Two kinds, picked by the
device type through `LORA_BATCHES`:

- `KernelLoRABatch` (CUDA): the kernels' metadata (one host-to-device copy per
  step) and the fused Triton shrink/expand, one launch per adapted linear: only
  the stacks of linears some resident adapter adapts (`LoRASlotPool.adapted_stacks`),
  named by `signature`, which keys the CUDA graphs that replay it.
- `GroupedCpuLoRABatch` (CPU): tokens sorted by slot once per step; per linear
  one gather of x, then per slot one exact-rank shrink matmul for all its
  slices (their A stacked at slot-write time) and one fused expand-add
  (`addmm_`) per slice over contiguous views, and one `index_add_`
  back into y (none of that copying when the adapted rows are already one run,
  as in a prefill). It moves only the bytes each adapter has: padding all
  slots to the largest rank and batching them with `bmm` measured 1.8x slower
  here (8 adapters of ranks 4-64). Slot contents come from the pool's
  plain-Python slice table, so no tensor is read to find them. It computes
  what the kernels' PyTorch reference (`add_lora_ref`) does; a test holds them
  equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from loraplex.engine.kernels.lora_metadata import LoRAMetadata, build_lora_metadata
from loraplex.engine.kernels.lora_weights import LoRAStack
from loraplex.engine.lora.slot_pool import EVERY_LINEAR, LoRASlotPool, StackKey

Slices = tuple[tuple[str, int, int], ...]
AddLoRA = Callable[[torch.Tensor, torch.Tensor, LoRAStack, LoRAMetadata], None]


class LoRABatch(Protocol):
    def apply(self, x: torch.Tensor, y: torch.Tensor, layer_index: int, slices: Slices) -> None: ...


@dataclass(slots=True)
class KernelLoRABatch:
    meta: LoRAMetadata
    stacks: dict[StackKey, LoRAStack]
    add_lora: AddLoRA
    signature: str = EVERY_LINEAR  # which linears `stacks` covers (`LoRASlotPool.adapted_signature`)

    @classmethod
    def build(cls, token_slots: list[int], pool: LoRASlotPool, signature: str | None = None) -> KernelLoRABatch:
        """`signature`: carry that set of linears' stacks (a graph captured for it) instead of the adapted ones."""
        from loraplex.engine.kernels.lora_triton import add_lora

        if signature is None:
            stacks, signature = pool.adapted_stacks, pool.adapted_signature
        else:
            stacks = pool.stacks_for(signature)
        return cls(cached_metadata(token_slots, pool), stacks, add_lora, signature)

    def apply(self, x: torch.Tensor, y: torch.Tensor, layer_index: int, slices: Slices) -> None:
        stack = self.stacks.get((layer_index, slices))
        if stack is not None:
            self.add_lora(y, x, stack, self.meta)

    def fused_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer_index: int,
                     slices: Slices) -> torch.Tensor | None:
        """x @ weight.T plus the LoRA delta in one launch (`lora_gemm`) for decode-sized batches; None
        where that kernel does not apply (the layer then runs its GEMM and `apply`)."""
        if x.shape[0] not in FUSED_LINEAR_ROWS:
            return None
        stack = self.stacks.get((layer_index, slices))
        if stack is None:
            return None
        from loraplex.engine.kernels import lora_gemm

        if not lora_gemm.supports(x, weight, bias, stack, self.meta):
            return None
        return lora_gemm.linear_with_lora(x, weight, stack, self.meta)


@dataclass(slots=True)
class GroupedCpuLoRABatch:
    pool: LoRASlotPool
    perm: torch.Tensor | None            # adapted rows sorted by slot; None when they already are, in one run
    groups: list[tuple[int, int, int]]   # (slot, start, end) in sorted order
    num_adapted: int
    first_row: int                       # with perm None: the adapted rows are [first_row, first_row + n)

    @classmethod
    def build(cls, token_slots: list[int], pool: LoRASlotPool, signature: str | None = None) -> GroupedCpuLoRABatch:
        """`signature` is the kernels' (no graphs here): this path skips slots without a slice at each linear."""
        slots = np.asarray(token_slots, dtype=np.int64)
        adapted = np.flatnonzero(slots >= 0)
        order = adapted[np.argsort(slots[adapted], kind="stable")]
        group_slots, starts, counts = np.unique(slots[order], return_index=True, return_counts=True)
        groups = [(int(s), int(b), int(b + n)) for s, b, n in zip(group_slots, starts, counts, strict=True)]
        in_place = len(order) > 0 and bool((np.diff(order) == 1).all())
        return cls(pool, None if in_place else torch.from_numpy(order), groups, len(order),
                   int(order[0]) if len(order) else 0)

    def apply(self, x: torch.Tensor, y: torch.Tensor, layer_index: int, slices: Slices) -> None:
        key = (layer_index, slices)
        table = self.pool.slot_slices.get(key)
        if not table or not any(slot in table for slot, _, _ in self.groups):
            return
        stack = self.pool.stacks[key]
        if self.perm is None:  # one run of rows (a prefill, or decodes in slot order): work on views of x and y
            rows = slice(self.first_row, self.first_row + self.num_adapted)
            xs, delta = x[rows], y[rows]
        else:
            xs = x.index_select(0, self.perm)
            delta = torch.zeros(self.num_adapted, y.shape[1], dtype=y.dtype)
        shrink_a = self.pool.shrink_a[key]
        for slot, start, end in self.groups:
            entries = table.get(slot)
            if not entries:
                continue
            shrunk = xs[start:end] @ shrink_a[slot].T  # every slice of this slot in one matmul
            for e in entries:
                lora_b = stack.lora_b[slot, e.out_start : e.out_end, : e.rank]
                delta[start:end, e.out_start : e.out_end].addmm_(shrunk[:, e.col_start : e.col_end], lora_b.T,
                                                                  alpha=e.scaling)
        if self.perm is not None:
            y.index_add_(0, self.perm, delta)


# Batch sizes whose adapted linears run base GEMM and LoRA delta in one launch (`lora_gemm`): at decode
# the separate LoRA kernel after each GEMM is ~10 us of latency a linear (H100, Llama-8B, 8 adapters at
# batch 64). An empty range turns it off.
FUSED_LINEAR_ROWS: range = range(16, 65)

METADATA_CACHE_SIZE = 8         # adapter mixes remembered per pool
METADATA_CACHE_MAX_TOKENS = 512  # decode-sized batches repeat their mix step after step; prefill chunks rarely


def cached_metadata(token_slots: list[int], pool: LoRASlotPool) -> LoRAMetadata:
    """The kernels' metadata for this adapter mix, built (host work and a copy) only when the mix
    is new: a decode batch keeps its mix for many steps. The metadata names slots, never weights,
    so an adapter rewritten into a slot needs no new metadata. A CUDA graph recognises an unchanged
    metadata by identity and skips even the device copy (`DecodeGraph.replay_forward`)."""
    if len(token_slots) > METADATA_CACHE_MAX_TOKENS:
        return build_lora_metadata(token_slots, max_loras=pool.max_loras, device=pool.device)
    cache = pool.metadata_cache
    key = tuple(token_slots)
    meta = cache.get(key)
    if meta is None:
        meta = cache[key] = build_lora_metadata(token_slots, max_loras=pool.max_loras, device=pool.device)
        if len(cache) > METADATA_CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return meta


LORA_BATCHES: dict[str, Callable[[list[int], LoRASlotPool, str | None], LoRABatch]] = {
    "cpu": GroupedCpuLoRABatch.build,
    "cuda": KernelLoRABatch.build,
}
