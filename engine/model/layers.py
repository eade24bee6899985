"""Building blocks of the Llama family: RMSNorm, rotary embedding, and the
one LoRA-ready linear layer every adaptable projection goes through."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from loraplex.engine.context import StepContext


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same arithmetic as below without casts
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with cos/sin precomputed for every position."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> ([T, 1, head_dim], [T, 1, head_dim]), computed once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class LoRALinear(nn.Module):
    """A linear layer that LoRA adapters can target, possibly several projections merged.

    The output is the concatenation of named slices (e.g. q_proj, k_proj,
    v_proj merged into one matmul); `slices` is a tuple of
    `(module_name, out_start, out_end)` in output columns, and
    `layer_index` is the decoder layer this projection belongs to.

    LoRA hook contract: after computing the base output `y = x @ W.T (+ b)`,
    if `ctx.lora is not None` the layer calls
    `ctx.lora.apply(x, y, layer_index, slices)`, which must add each slice's
    LoRA delta into `y[:, out_start:out_end]` in place. `x` is `[tokens, in]`
    with tokens in the step's batch order (the same order the runner passed
    to its `lora.build(...)`). With `ctx.lora is None` (the default) no
    adapter code runs at all.
    """

    def __init__(
        self,
        in_features: int,
        out_slices: list[tuple[str, int]],
        layer_index: int,
        bias: bool = False,
    ) -> None:
        super().__init__()
        slices = []
        start = 0
        for name, size in out_slices:
            slices.append((name, start, start + size))
            start += size
        self.slices: tuple[tuple[str, int, int], ...] = tuple(slices)
        self.layer_index = layer_index
        self.in_features = in_features
        self.out_features = start
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.zeros(start)) if bias else None

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if ctx.lora is not None:
            ctx.lora.apply(x, y, self.layer_index, self.slices)
        return y

    def slice_of(self, module_name: str) -> tuple[int, int]:
        for name, start, end in self.slices:
            if name == module_name:
                return start, end
        raise KeyError(module_name)
