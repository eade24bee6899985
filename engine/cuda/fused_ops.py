"""Fused Triton ops the CUDA runner swaps in for chains of small PyTorch kernels.

A decode step at batch 1 is a few large weight reads and many tiny elementwise kernels; in
PyTorch an RMSNorm is 8 launches and rotary embedding 7 per tensor, which at ~2 µs each on a
32-layer model costs more than a millisecond. Each op here is one launch and rounds where its
PyTorch reference (`RMSNorm.forward`, `apply_rotary`) rounds, so bf16 results stay close.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.engine.model.layers import RMSNorm, apply_rotary
from torch import nn


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, x_row_stride, out_row_stride, num_cols, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference casts back first
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), rows.shape[1], eps,
            BLOCK=triton.next_power_of_2(rows.shape[1]), num_warps=4 if rows.shape[1] <= 2048 else 8,
        )
    return out.view(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps).to(device=x.device, dtype=weight.dtype)
    norm.weight.data = weight
    return norm(x)


class TritonRMSNorm(nn.Module):
    """Drop-in for `RMSNorm` (same parameter, so state dicts and tied weights are unchanged)."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def fuse_norms(model: nn.Module) -> int:
    """Replace every `RMSNorm` submodule by its Triton twin, in place; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, RMSNorm)]
    for parent, name, child in swaps:
        setattr(parent, name, TritonRMSNorm(child))
    return len(swaps)


@triton.jit
def _rotate_heads(x_ptr, head_stride, num_heads, c1, c2, s1, s2, half, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first = x_ptr + heads * head_stride + dims
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # As the reference: x * cos and rotate_half(x) * sin each rounded to x's dtype, then summed.
    out1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    out2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + half, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_token_stride, q_head_stride, k_token_stride,
                   k_head_stride, cos_sin_stride, num_q_heads, num_k_heads, half,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < half
    dtype = q_ptr.dtype.element_ty
    table = token * cos_sin_stride + dims
    c1 = tl.load(cos_ptr + table, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + table + half, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + table + half, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr + token * q_token_stride, q_head_stride, num_q_heads, c1, c2, s1, s2, half,
                  BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * k_token_stride, k_head_stride, num_k_heads, c1, c2, s1, s2, half,
                  BLOCK_HK, BLOCK_HALF)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox rotary on q [T, Hq, D] and k [T, Hk, D] in place (any token/head strides, D contiguous);
    cos/sin [T, 1, D] rows of the step's positions (one launch for both tensors)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("rotary_ needs head_dim contiguous")
    cos = cos.reshape(num_tokens, head_dim)
    sin = sin.reshape(num_tokens, head_dim)
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        num_q_heads, k.shape[1], half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
    )


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    q.copy_(apply_rotary(q, cos, sin))
    k.copy_(apply_rotary(k, cos, sin))
