"""PyTorch reference LoRA ops: the CPU path, and the oracle the Triton kernels are tested against.

Same signatures as ``lora_triton``. They read only the token view of the metadata
(``token_slots``), so a test against them also checks the group and tile views the
kernels use. Arithmetic follows the kernels: shrink accumulates in float32; expand scales
the float32 shrink result, rounds it to the weights' dtype, multiplies by B with a
float32 accumulator, adds into y and rounds once.
"""

from __future__ import annotations

import torch
from loraplex.engine.kernels.lora_metadata import LoRAMetadata
from loraplex.engine.kernels.lora_weights import LoRAStack


def _slot_rows(meta: LoRAMetadata) -> list[tuple[int, torch.Tensor]]:
    slots = meta.token_slots.to(torch.int64)
    return [(int(slot), torch.nonzero(slots == slot).flatten()) for slot in torch.unique(slots) if slot >= 0]


def lora_shrink_ref(x: torch.Tensor, stack: LoRAStack, meta: LoRAMetadata) -> torch.Tensor:
    """[T, num_slices * max_rank] float32: slice i at columns i*max_rank...; zero where no adapter."""
    rank_pad = stack.max_rank
    shrunk = torch.zeros(x.shape[0], stack.num_slices * rank_pad, dtype=torch.float32, device=x.device)
    for slot, rows in _slot_rows(meta):
        xs = x[rows].float()
        for i in range(stack.num_slices):
            rank = int(stack.ranks[slot, i])
            if rank:
                cols = slice(i * rank_pad, i * rank_pad + rank)
                shrunk[rows, cols] = xs @ stack.lora_a[slot, i, :rank].float().T
    return shrunk


def lora_expand_ref(shrunk: torch.Tensor, y: torch.Tensor, stack: LoRAStack, meta: LoRAMetadata) -> None:
    """y[:, slice i] += scaling * shrunk[:, slice i] @ B_i.T, in place; rows with no adapter untouched."""
    rank_pad = stack.max_rank
    for slot, rows in _slot_rows(meta):
        for i in range(stack.num_slices):
            rank = int(stack.ranks[slot, i])
            if not rank:
                continue
            start = stack.out_offset(i)
            stop = start + stack.out_sizes[i]
            scaled = (shrunk[rows, i * rank_pad : i * rank_pad + rank] * stack.scalings[slot, i]).to(y.dtype)
            delta = scaled.float() @ stack.lora_b[slot, start:stop, :rank].float().T
            y[rows, start:stop] = (y[rows, start:stop].float() + delta).to(y.dtype)


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRAMetadata) -> None:
    """Fused form: y += per-token-slot LoRA delta of x, for every slice of the layer."""
    lora_expand_ref(lora_shrink_ref(x, stack, meta), y, stack, meta)
