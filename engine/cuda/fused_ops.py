"""Fused Triton ops the CUDA runner swaps in for chains of small PyTorch kernels.

A decode step at batch 1 is a few large weight reads and many tiny elementwise kernels; in
PyTorch an RMSNorm is 8 launches and rotary embedding 7 per tensor, which at ~2 µs each on a
32-layer model costs more than a millisecond. Each op here is one launch and rounds where its
PyTorch reference (`RMSNorm.forward`, `apply_rotary`) rounds, so bf16 results stay close.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from loraplex.engine.model.layers import RMSNorm, SiluAndMul, apply_rotary
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

        object.__setattr__(self, "original", norm)  # not a submodule: no second copy of the weight's name

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As `RMSNorm.forward`; with a residual, it is updated in place (one kernel for add + norm)."""
        if residual is not None:
            if residual.stride(-1) == 1 and x.shape == residual.shape and residual.is_contiguous():
                return add_rms_norm_(x, residual, self.weight, self.eps)
            total = x + residual
            return rms_norm(total, self.weight, self.eps), total
        return rms_norm(x, self.weight, self.eps)


class TritonSiluAndMul(nn.Module):
    def __init__(self, original: SiluAndMul) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)


def fuse_norms(model: nn.Module) -> int:
    """Replace every `RMSNorm` submodule by its Triton twin, in place; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, RMSNorm)]
    for parent, name, child in swaps:
        setattr(parent, name, TritonRMSNorm(child))
    return len(swaps)


def fuse_model(model: nn.Module, *, elementwise: bool = True, gemv: bool = True) -> None:
    """Install the CUDA runner's fused ops in place: Triton RMSNorm (with the residual add), SiLU x
    mul in one kernel, and the batch-1 GEMV for every linear layer and the LM head. Calling it
    again with other flags puts the PyTorch modules back (benchmarks compare both)."""
    from loraplex.engine.cuda.gemv import decode_linear
    from loraplex.engine.model.layers import LoRALinear, VocabParallelHead

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm | SiluAndMul) and elementwise:
                setattr(parent, name, TritonRMSNorm(child) if isinstance(child, RMSNorm) else TritonSiluAndMul(child))
            elif isinstance(child, TritonRMSNorm | TritonSiluAndMul) and not elementwise:
                setattr(parent, name, child.original)
    for module in model.modules():
        if isinstance(module, LoRALinear | VocabParallelHead):
            if gemv:
                module.matmul = decode_linear
            elif "matmul" in module.__dict__:
                del module.matmul


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2):
    """As the reference: x * cos and rotate_half(x) * sin each rounded to x's dtype, then summed."""
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    out1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    out2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, token, cos_sin_stride, half, dtype, BLOCK_HALF: tl.constexpr):
    """The token's cos/sin halves, rounded to the activations' dtype like the reference's."""
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < half
    table = token * cos_sin_stride + dims
    c1 = tl.load(cos_ptr + table, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + table + half, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + table + half, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rotate_heads(x_ptr, head_stride, num_heads, c1, c2, s1, s2, half, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first = x_ptr + heads * head_stride + dims
    out1, out2 = _rotate(tl.load(first, mask=mask, other=0.0), tl.load(first + half, mask=mask, other=0.0),
                         c1, c2, s1, s2)
    tl.store(first, out1, mask=mask)
    tl.store(first + half, out2, mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_token_stride, q_head_stride, k_token_stride,
                   k_head_stride, cos_sin_stride, num_q_heads, num_k_heads, half,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, token, cos_sin_stride, half, q_ptr.dtype.element_ty, BLOCK_HALF)
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


# ---- residual add + RMSNorm ------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_row_stride, residual_row_stride,
                         out_row_stride, num_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + residual).to(residual_ptr.dtype.element_ty)  # the reference's `hidden + out`, rounded
    tl.store(residual_ptr + row * residual_row_stride + cols, total, mask=mask)
    total = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(total * total, axis=0) / num_cols + eps)
    normed = (total * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (rounded to residual's dtype, in place); returns (RMSNorm(residual), residual).
    One launch for what the reference does in two passes (`RMSNorm.forward` with a residual)."""
    rows = x.reshape(-1, x.shape[-1])
    res = residual.view(-1, residual.shape[-1])
    if rows.stride(-1) != 1 or res.stride(-1) != 1:
        raise ValueError("add_rms_norm_ needs contiguous rows")
    out = torch.empty(rows.shape, dtype=residual.dtype, device=x.device)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, rows.stride(0), res.stride(0), out.stride(0), rows.shape[1], eps,
            BLOCK=triton.next_power_of_2(rows.shape[1]), num_warps=4 if rows.shape[1] <= 2048 else 8,
        )
    return out.view(residual.shape), residual


# ---- SiLU(gate) * up ------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, row_stride, out_row_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * row_stride + width + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu rounds to the dtype first
    tl.store(out_ptr + row * out_row_stride + cols, (act * up.to(tl.float32)).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2n] (gate columns, then up) -> [T, n] = silu(gate) * up, one launch."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    width = rows.shape[1] // 2
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = min(2048, triton.next_power_of_2(width))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
            rows, out, rows.stride(0), out.stride(0), width, BLOCK=block, num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], width)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- rotary + paged K/V write ---------------------------------------------------------------
@triton.jit
def _rotary_kv_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                            q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride,
                            v_head_stride, cos_sin_stride, cache_block_stride, cache_slot_stride,
                            cache_head_stride, block_size, num_q_heads, num_k_heads, half, head_dim,
                            BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < half
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, token, cos_sin_stride, half, q_ptr.dtype.element_ty, BLOCK_HALF)
    # q in place
    q_heads = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = (q_heads < num_q_heads) & dim_mask
    q_first = q_ptr + token * q_token_stride + q_heads * q_head_stride + dims
    q1, q2 = _rotate(tl.load(q_first, mask=q_mask, other=0.0), tl.load(q_first + half, mask=q_mask, other=0.0),
                     c1, c2, s1, s2)
    tl.store(q_first, q1, mask=q_mask)
    tl.store(q_first + half, q2, mask=q_mask)
    # k in place and into the cache; v into the cache
    k_heads = tl.arange(0, BLOCK_HK)[:, None]
    k_mask = (k_heads < num_k_heads) & dim_mask
    k_first = k_ptr + token * k_token_stride + k_heads * k_head_stride + dims
    k1, k2 = _rotate(tl.load(k_first, mask=k_mask, other=0.0), tl.load(k_first + half, mask=k_mask, other=0.0),
                     c1, c2, s1, s2)
    tl.store(k_first, k1, mask=k_mask)
    tl.store(k_first + half, k2, mask=k_mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        cache = (slot // block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride \
            + k_heads * cache_head_stride + dims
        cache_dtype = key_cache_ptr.dtype.element_ty
        tl.store(key_cache_ptr + cache, k1.to(cache_dtype), mask=k_mask)
        tl.store(key_cache_ptr + cache + half, k2.to(cache_dtype), mask=k_mask)
        v_first = v_ptr + token * v_token_stride + k_heads * v_head_stride + dims
        v1 = tl.load(v_first, mask=k_mask, other=0.0)
        v2 = tl.load(v_first + half, mask=k_mask, other=0.0)
        tl.store(value_cache_ptr + cache, v1.to(cache_dtype), mask=k_mask)
        tl.store(value_cache_ptr + cache + half, v2.to(cache_dtype), mask=k_mask)


def rotary_write_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`rotary_(q, k, cos, sin)` then `write_kv_cache(k, v, key_cache, value_cache, slot_mapping)` in one
    launch: q and k rotated in place, rotated k and v stored at their slots (slot -1: not stored).
    Caches are [blocks, block_size, kv_heads, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError("rotary_write_kv_ needs head_dim contiguous")
    if key_cache.stride() != value_cache.stride() or head_dim % 2:
        raise ValueError("key and value caches must share one layout; head_dim must be even")
    cos = cos.reshape(num_tokens, head_dim)
    sin = sin.reshape(num_tokens, head_dim)
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    half = head_dim // 2
    _rotary_kv_write_kernel[(num_tokens,)](
        q, k, v, cos, sin, key_cache, value_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.shape[1],
        num_q_heads, k.shape[1], half, head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
    )
