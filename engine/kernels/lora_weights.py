"""The device layout of one merged linear's LoRA slots, as the LoRA kernels read it.

A merged projection (q/k/v, or gate/up) computes y = x @ W.T with y = [T, sum(out_sizes)]
split into named slices; every slice has its own adapter A/B per slot. All slices of all
slots live in two stacked buffers so that one kernel launch serves the whole layer:

    lora_a    [num_slots, num_slices, max_rank, in_features]
    lora_b    [num_slots, sum(out_sizes), max_rank]   (slice i owns rows out_offsets[i]:...)
    ranks     int32   [num_slots, num_slices]  0 = this slot has no adapter for this slice
    scalings  float32 [num_slots, num_slices]  lora_alpha / r (or / sqrt(r) for rsLoRA)

Rows of A (and columns of B) at or past a slot's rank are never read by the kernels, so a
slot of rank 8 in a max_rank 64 buffer moves only its own bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SLICES = 3


@dataclass(slots=True)
class LoRAStack:
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    out_sizes: tuple[int, ...]

    @classmethod
    def allocate(
        cls,
        *,
        num_slots: int,
        max_rank: int,
        in_features: int,
        out_sizes: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> LoRAStack:
        if not 1 <= len(out_sizes) <= MAX_SLICES:
            raise ValueError(f"a merged linear has 1 to {MAX_SLICES} slices, got {len(out_sizes)}")
        num_slices = len(out_sizes)
        return cls(
            lora_a=torch.zeros(num_slots, num_slices, max_rank, in_features, dtype=dtype, device=device),
            lora_b=torch.zeros(num_slots, sum(out_sizes), max_rank, dtype=dtype, device=device),
            ranks=torch.zeros(num_slots, num_slices, dtype=torch.int32, device=device),
            scalings=torch.zeros(num_slots, num_slices, dtype=torch.float32, device=device),
            out_sizes=tuple(out_sizes),
        )

    @property
    def num_slots(self) -> int:
        return self.lora_a.shape[0]

    @property
    def num_slices(self) -> int:
        return self.lora_a.shape[1]

    @property
    def max_rank(self) -> int:
        return self.lora_a.shape[2]

    @property
    def in_features(self) -> int:
        return self.lora_a.shape[3]

    @property
    def out_features(self) -> int:
        return self.lora_b.shape[1]

    def out_offset(self, slice_index: int) -> int:
        return sum(self.out_sizes[:slice_index])

    def set_slot(
        self, slot: int, slice_index: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
    ) -> None:
        """Write one adapter module ([r, in] A, [out_i, r] B) into a slot, zeroing the padding."""
        rank = lora_a.shape[0]
        start = self.out_offset(slice_index)
        stop = start + self.out_sizes[slice_index]
        self.lora_a[slot, slice_index].zero_()
        self.lora_a[slot, slice_index, :rank].copy_(lora_a)
        self.lora_b[slot, start:stop].zero_()
        self.lora_b[slot, start:stop, :rank].copy_(lora_b)
        self.ranks[slot, slice_index] = rank
        self.scalings[slot, slice_index] = scaling

    def clear_slot(self, slot: int) -> None:
        """Mark every slice of a slot as 'no adapter' (the kernels then skip it)."""
        self.ranks[slot].zero_()
