"""Rotary position embeddings' inverse frequencies, as transformers computes them for each scaling type."""

from __future__ import annotations

import math
from typing import Any

import torch
from loraplex.engine.config import ModelConfig


def rope_inv_freq(config: ModelConfig, max_model_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, as transformers computes them.

    `dynamic` NTK scaling is applied statically for `max_model_len` when that
    exceeds the trained length (as vLLM does), since paged K/V are stored
    already rotated.
    """
    dim = config.head_dim
    base = config.rope_theta
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "dynamic":
        factor = scaling["factor"]
        original = config.max_position_embeddings
        if max_model_len > original:
            base = base * ((factor * max_model_len / original) - (factor - 1)) ** (dim / (dim - 2))
    # Always on the CPU, whatever default device is in force: under the loader's `torch.device("meta")` these ops
    # would run through torch._refs, whose first call imports torch._dynamo (~2 s of every engine start).
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type not in ("default", "dynamic"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)
