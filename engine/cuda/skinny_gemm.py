"""Skinny GEMM in Triton: y[M, N] = x[M, K] @ W[N, K].T for steps of 2 to 128 rows.

A decode step of a few dozen rows is still a weight read: at 64 rows a Llama-8B projection does
64 multiply-adds per weight element, a third of what an H100/H200 needs to be compute-bound.
cuBLAS's kernels for these shapes leave a fifth or more of the copy bandwidth unused (on an
H200 the 8B's four projections take 131 µs a layer at 65 rows against ~101 µs of weight bytes);
the batch-1 GEMV (`gemv.py`) closes that gap at one row only, so a step's time jumped as soon as
a second row joined it.

Here the weight is the MMA's left operand ("swap AB"): each program owns BLOCK_N weight rows,
streams them in [BLOCK_N, BLOCK_K] tiles and multiplies by the [BLOCK_K, BLOCK_M] slice of x^T
(x's rows padded to BLOCK_M >= 16, what a tensor-core dot needs), so a 64-row MMA tile is filled by
weights, not by the few token rows; rows past 64 take a second dot on the same weight tile. Shapes with few output blocks split K over SPLITS programs
that write float32 partials; a second launch sums them in split order, so a result never depends
on which program finished first (deterministic, unlike atomics). Block shapes come from an H200
sweep (`benchmarks/gpu_decode_probe.py --skinny`); shapes not in `TUNED` keep `F.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 128  # up to here a bf16 linear stays bound by its weight read on a Hopper; past it cuBLAS keeps it
# Rows past 64 go to a second, smaller tile of the same weight tile (80 rows: 64 + 16) rather than one padded to
# 128, whose x tiles would halve the pipeline stages that fit in shared memory.
FIRST_TILE_ROWS = 64


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    splits: int = 1  # programs over K per output block; > 1 sums float32 partials in a second launch


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_om, stride_os,
                   HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr,
                   HAS_TAIL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   EVEN_N: tl.constexpr, EVEN_M: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n if EVEN_N else tl.where(offs_n < N, offs_n, N - 1)  # clamped re-reads; their stores are masked
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_t = BLOCK_M + tl.arange(0, TAIL_M)  # rows past the first tile: a second, smaller one (80 = 64 + 16)
    t_mask = offs_t < M
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + offs_m[None, :] * stride_xm  # x^T: the token rows are the dot's columns
    x_tail = x_ptr + offs_t[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_N, TAIL_M], dtype=tl.float32)
    k_begin = pid_k * K_PER
    for k in range(k_begin, k_begin + K_PER, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + offs_k[None, :])
            if EVEN_M:
                xt = tl.load(x_cols + offs_k[:, None])
            else:
                xt = tl.load(x_cols + offs_k[:, None], mask=m_mask[None, :], other=0.0)
            if HAS_TAIL:
                acc_t = tl.dot(w, tl.load(x_tail + offs_k[:, None], mask=t_mask[None, :], other=0.0), acc_t)
        else:
            k_mask = offs_k < K
            w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            xt = tl.load(x_cols + offs_k[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)
            if HAS_TAIL:
                xt_tail = tl.load(x_tail + offs_k[:, None], mask=k_mask[:, None] & t_mask[None, :], other=0.0)
                acc_t = tl.dot(w, xt_tail, acc_t)
        acc = tl.dot(w, xt, acc)
    _store_rows(acc, out_ptr, bias_ptr, offs_n, rows, offs_m, m_mask, pid_k, N, stride_om, stride_os,
                HAS_BIAS, PARTIAL)
    if HAS_TAIL:
        _store_rows(acc_t, out_ptr, bias_ptr, offs_n, rows, offs_t, t_mask, pid_k, N, stride_om, stride_os,
                    HAS_BIAS, PARTIAL)


@triton.jit
def _store_rows(acc, out_ptr, bias_ptr, offs_n, rows, offs_m, m_mask, pid_k, N, stride_om, stride_os,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """acc [BLOCK_N, rows] -> out[rows, offs_n]: float32 partials of this K split, or the result (+ bias)."""
    out = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = m_mask[None, :] & (offs_n < N)[:, None]
    if PARTIAL:
        tl.store(out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, y_ptr, total, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLITS):  # always in split order: the same bits every time
        acc += tl.load(part_ptr + split * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# (N, K) -> ((most rows, config or None for cuBLAS), ...) in rising row bounds; the first that covers M wins.
# Llama-3.1-8B's projections and a 49152-token LM head (SmolLM2's vocabulary on the 8B's hidden size); the
# sweep writes the block between the markers. µs per call, cuBLAS -> skinny, 64 rows: gate_up 65.5 -> 60.9,
# down 36.8 -> 35.0, head 104.9 -> 99.8; qkv and o stay on cuBLAS there (it was faster).
# SmolLM2-135M's shapes (`--skinny-model smollm2`, H200, 2026-12-03) are left out: each call is ~3-5 us of latency,
# the best config beat cuBLAS by at most ~0.5 us at 2-32 rows and lost at 48-64, and the engine's decode replay was
# no faster with them (16 rows 0.985 ms against 0.971, 48 rows 1.067 against 1.066).
# <sweep table>
# NVIDIA H200, benchmarks/gpu_decode_probe.py --skinny, 2026-12-03
TUNED: dict[tuple[int, int], tuple[tuple[int, SkinnyConfig | None], ...]] = {
    (4096, 4096): (
        (2, SkinnyConfig(64, 128, 4, 4, 2)),
        (8, SkinnyConfig(64, 128, 4, 4, 2)),
        (16, SkinnyConfig(64, 128, 4, 4, 2)),
        (32, SkinnyConfig(64, 128, 4, 4, 2)),
        (48, SkinnyConfig(64, 128, 4, 4, 2)),
        (64, None),
        (80, None),
        (128, None),
    ),
    (4096, 14336): (
        (2, SkinnyConfig(64, 128, 4, 4, 4)),
        (8, SkinnyConfig(64, 128, 4, 4, 4)),
        (16, SkinnyConfig(64, 128, 4, 4, 4)),
        (32, SkinnyConfig(64, 128, 4, 4, 2)),
        (48, SkinnyConfig(64, 128, 4, 4, 2)),
        (64, SkinnyConfig(64, 128, 4, 4, 2)),
        (80, SkinnyConfig(64, 128, 4, 4, 2)),
        (128, None),
    ),
    (6144, 4096): (
        (2, SkinnyConfig(64, 256, 4, 3, 1)),
        (8, None),
        (16, None),
        (32, None),
        (48, None),
        (64, None),
        (80, None),
        (128, None),
    ),
    (28672, 4096): (
        (2, SkinnyConfig(64, 128, 4, 4, 1)),
        (8, SkinnyConfig(64, 128, 4, 4, 1)),
        (16, None),
        (32, SkinnyConfig(128, 128, 8, 4, 1)),
        (48, SkinnyConfig(128, 128, 8, 4, 1)),
        (64, SkinnyConfig(128, 128, 8, 4, 1)),
        (80, SkinnyConfig(128, 128, 8, 4, 1)),
        (128, None),
    ),
    (49152, 4096): (
        (2, SkinnyConfig(64, 128, 4, 4, 1)),
        (8, SkinnyConfig(64, 128, 4, 4, 1)),
        (16, SkinnyConfig(64, 128, 4, 4, 1)),
        (32, SkinnyConfig(128, 128, 8, 4, 1)),
        (48, SkinnyConfig(128, 128, 8, 4, 1)),
        (64, SkinnyConfig(128, 128, 8, 4, 1)),
        (80, SkinnyConfig(128, 128, 8, 4, 1)),
        (128, None),
    ),
}
# </sweep table>


def config_for(m: int, n: int, k: int) -> SkinnyConfig | None:
    """The tuned config for M rows of an (N, K) weight, or None where cuBLAS is as fast or unmeasured."""
    for most_rows, config in TUNED.get((n, k), ()):
        if m <= most_rows:
            return config
    return None


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N] in x's dtype, for 1 <= M <= MAX_ROWS."""
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"skinny_gemm takes 1..{MAX_ROWS} rows of K features and a weight with contiguous rows")
    if x.stride(1) != 1:
        x = x.contiguous()
    config = config or config_for(m, n, k) or SkinnyConfig()
    block_m = max(16, triton.next_power_of_2(min(m, FIRST_TILE_ROWS)))
    tail_m = max(16, triton.next_power_of_2(m - FIRST_TILE_ROWS)) if m > FIRST_TILE_ROWS else 16
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    splits = max(1, min(config.splits, triton.cdiv(k, block_k)))
    k_per = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per)  # no split left without work
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = splits > 1
    out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partial else y
    grid = (triton.cdiv(n, config.block_n), splits)
    _skinny_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k, k_per, x.stride(0), weight.stride(0),
        n, m * n, HAS_BIAS=bias is not None, PARTIAL=partial, BLOCK_M=block_m, TAIL_M=tail_m,
        HAS_TAIL=m > FIRST_TILE_ROWS, BLOCK_N=config.block_n, BLOCK_K=block_k,
        EVEN_K=k_per * splits == k and k % block_k == 0, EVEN_N=n % config.block_n == 0, EVEN_M=m >= block_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if partial:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            out, bias if bias is not None else out, y, m * n, n, SPLITS=splits, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=4)
    return y
