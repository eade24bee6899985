"""The per-step LoRA context the model's LoRA-ready linears call.

Built once per step (token -> slot metadata, one host-to-device copy) and
shared by every layer: `apply(x, y, layer_index, slices)` adds each slice's
delta into `y` through the kernel backend of the device: the Triton kernels on
CUDA, the PyTorch references (same signature) on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from loraplex.engine.kernels.lora_metadata import LoRAMetadata, build_lora_metadata
from loraplex.engine.kernels.lora_reference import add_lora_ref
from loraplex.engine.kernels.lora_weights import LoRAStack
from loraplex.engine.lora.slot_pool import LoRASlotPool, StackKey

AddLoRA = Callable[[torch.Tensor, torch.Tensor, LoRAStack, LoRAMetadata], None]


def _triton_add_lora() -> AddLoRA:
    from loraplex.engine.kernels.lora_triton import add_lora

    return add_lora


LORA_BACKENDS: dict[str, Callable[[], AddLoRA]] = {
    "cpu": lambda: add_lora_ref,
    "cuda": _triton_add_lora,
}


def lora_backend_for(device: torch.device) -> AddLoRA:
    return LORA_BACKENDS[device.type]()


@dataclass(slots=True)
class LoRABatch:
    meta: LoRAMetadata
    stacks: dict[StackKey, LoRAStack]
    add_lora: AddLoRA

    @classmethod
    def build(cls, token_slots: list[int], pool: LoRASlotPool, add_lora: AddLoRA) -> LoRABatch:
        meta = build_lora_metadata(token_slots, max_loras=pool.max_loras, device=pool.device)
        return cls(meta, pool.stacks, add_lora)

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, layer_index: int, slices: tuple[tuple[str, int, int], ...]
    ) -> None:
        stack = self.stacks.get((layer_index, slices))
        if stack is not None:
            self.add_lora(y, x, stack, self.meta)
