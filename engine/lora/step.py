"""The per-step LoRA context the model's LoRA-ready linears call.

Built once per step and shared by every layer: `apply(x, y, layer_index,
slices)` adds each slice's delta into `y` in place. Two kinds, picked by the
device type through `LORA_BATCHES`:

- `KernelLoRABatch` (CUDA): the kernels' metadata (one host-to-device copy per
  step) and the fused Triton shrink/expand, one launch per linear.
- `PaddedCpuLoRABatch` (CPU): tokens grouped by slot once per step and padded
  to the longest group, so each linear costs one gather of x, then per slice
  one batched shrink (bmm over slots), one batched expand and one `index_add_`
  back into y: a handful of large ops instead of a loop over adapters, which
  is what a CPU (and PEFT's per-adapter loop) pays for. Ranks are cut to the
  largest rank active in the step; slices a slot does not adapt have scaling
  0. It computes what the kernels' PyTorch reference (`add_lora_ref`) does; a
  test holds them equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from loraplex.engine.kernels.lora_metadata import LoRAMetadata, build_lora_metadata
from loraplex.engine.kernels.lora_weights import LoRAStack
from loraplex.engine.lora.slot_pool import LoRASlotPool, StackKey

Slices = tuple[tuple[str, int, int], ...]
AddLoRA = Callable[[torch.Tensor, torch.Tensor, LoRAStack, LoRAMetadata], None]


class LoRABatch(Protocol):
    def apply(self, x: torch.Tensor, y: torch.Tensor, layer_index: int, slices: Slices) -> None: ...


@dataclass(slots=True)
class KernelLoRABatch:
    meta: LoRAMetadata
    stacks: dict[StackKey, LoRAStack]
    add_lora: AddLoRA

    @classmethod
    def build(cls, token_slots: list[int], pool: LoRASlotPool) -> KernelLoRABatch:
        from loraplex.engine.kernels.lora_triton import add_lora

        meta = build_lora_metadata(token_slots, max_loras=pool.max_loras, device=pool.device)
        return cls(meta, pool.stacks, add_lora)

    def apply(self, x: torch.Tensor, y: torch.Tensor, layer_index: int, slices: Slices) -> None:
        stack = self.stacks.get((layer_index, slices))
        if stack is not None:
            self.add_lora(y, x, stack, self.meta)


@dataclass(slots=True)
class PaddedCpuLoRABatch:
    pool: LoRASlotPool
    group_slots: list[int]          # active slots, ascending
    slot_index: torch.Tensor        # the same, as a tensor (for gathering weights)
    slots_are_prefix: bool          # group_slots == [0, 1, ..., G-1]: the weights need no gather
    rows_padded: torch.Tensor       # [G * L] row of x for each padded position (pads repeat a real row)
    valid_positions: torch.Tensor | None  # padded positions holding real rows; None when nothing is padded
    valid_rows: torch.Tensor        # the row of y each valid position adds into
    max_group_len: int

    @classmethod
    def build(cls, token_slots: list[int], pool: LoRASlotPool) -> PaddedCpuLoRABatch:
        slots = np.asarray(token_slots, dtype=np.int64)
        adapted = np.flatnonzero(slots >= 0)
        order = adapted[np.argsort(slots[adapted], kind="stable")]
        group_slots, starts, counts = np.unique(slots[order], return_index=True, return_counts=True)
        num_groups, width = len(group_slots), int(counts.max()) if len(counts) else 0
        padded = np.empty(num_groups * width, dtype=np.int64)
        valid = np.zeros(num_groups * width, dtype=bool)
        for g, (start, count) in enumerate(zip(starts, counts, strict=True)):
            rows = order[start : start + count]
            padded[g * width : g * width + count] = rows
            padded[g * width + count : (g + 1) * width] = rows[0]
            valid[g * width : g * width + count] = True
        positions = np.flatnonzero(valid)
        return cls(
            pool=pool,
            group_slots=[int(v) for v in group_slots],
            slot_index=torch.from_numpy(group_slots.astype(np.int64)),
            slots_are_prefix=bool((group_slots == np.arange(num_groups)).all()),
            rows_padded=torch.from_numpy(padded),
            valid_positions=None if valid.all() else torch.from_numpy(positions),
            valid_rows=torch.from_numpy(padded[positions]),
            max_group_len=width,
        )

    def apply(self, x: torch.Tensor, y: torch.Tensor, layer_index: int, slices: Slices) -> None:
        key = (layer_index, slices)
        table = self.pool.slot_slices.get(key)
        if not table:
            return
        entries = [e for slot in self.group_slots for e in table.get(slot, ())]
        if not entries:
            return
        rank = max(e.rank for e in entries)
        stack = self.pool.stacks[key]
        num_groups = len(self.group_slots)
        lora_a, lora_b = stack.lora_a[:, :, :rank], stack.lora_b[:, :, :rank]
        scalings = self.pool.slice_scalings[key]
        if self.slots_are_prefix:
            lora_a, lora_b, scalings = lora_a[:num_groups], lora_b[:num_groups], scalings[:num_groups]
        else:
            lora_a = lora_a.index_select(0, self.slot_index)
            lora_b = lora_b.index_select(0, self.slot_index)
            scalings = scalings.index_select(0, self.slot_index)
        xs = x.index_select(0, self.rows_padded).view(num_groups, self.max_group_len, -1)
        for i in sorted({e.index for e in entries}):
            start = stack.out_offset(i)
            stop = start + stack.out_sizes[i]
            shrunk = torch.bmm(xs, lora_a[:, i].transpose(1, 2))
            shrunk.mul_(scalings[:, i].view(num_groups, 1, 1).to(shrunk.dtype))
            delta = torch.bmm(shrunk, lora_b[:, start:stop].transpose(1, 2)).view(-1, stop - start)
            if self.valid_positions is not None:
                delta = delta.index_select(0, self.valid_positions)
            y[:, start:stop].index_add_(0, self.valid_rows, delta)


LORA_BATCHES: dict[str, Callable[[list[int], LoRASlotPool], LoRABatch]] = {
    "cpu": PaddedCpuLoRABatch.build,
    "cuda": KernelLoRABatch.build,
}
