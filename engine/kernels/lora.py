"""The multi-LoRA op the model calls: the Triton kernels on CUDA, the PyTorch reference elsewhere.

Per step: ``build_lora_metadata`` (or ``build_lora_metadata_for_segments``) once; per
adapted linear: ``add_lora(y, x, stack, meta)`` right after ``y = x @ W.T``.
"""

from __future__ import annotations

import torch
from loraplex.engine.kernels.lora_metadata import LoRAMetadata
from loraplex.engine.kernels.lora_reference import add_lora_ref
from loraplex.engine.kernels.lora_weights import LoRAStack


def add_lora(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRAMetadata) -> None:
    """y[t] += scaling * (x[t] @ A_s.T) @ B_s.T for every slice, s = meta.token_slots[t]; -1 adds nothing."""
    if y.is_cuda:
        from loraplex.engine.kernels.lora_triton import add_lora as add_lora_triton

        add_lora_triton(y, x, stack, meta)
    else:
        add_lora_ref(y, x, stack, meta)
