"""Batch-1 GEMV in Triton: y[1, N] = x[1, K] @ W[N, K].T for the decode step of one sequence.

At one row a linear layer is a pure weight read; cuBLAS picks a kernel for M = 1 that leaves
part of the copy bandwidth unused on the skinny shapes of a Llama layer. Each program here owns
BLOCK_N weight rows, streams them in [BLOCK_N, BLOCK_K] tiles (16-byte loads along K), keeps a
float32 [BLOCK_N, BLOCK_K] accumulator and reduces it once at the end: no split-K, no atomics,
so results are deterministic (the same step gives the same bits every time). Block shapes come
from an H100 sweep (`benchmarks/gpu_decode_probe.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from loraplex.engine.cuda import skinny_gemm


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if not EVEN_N:
        rows = tl.where(rows < N, rows, N - 1)  # clamped re-reads of the last row; their stores are masked
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + cols)
            w = tl.load(w_rows + cols[None, :])
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    out = y_ptr + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        tl.store(out, y.to(y_ptr.dtype.element_ty))
    else:
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N) < N)


# (block_n, block_k, num_warps, num_stages). Sweep on an H100 (copy rate 2994 GB/s; µs per call over 8
# distinct weights in one graph, cuBLAS in brackets): Llama-8B qkv 19.0 (24.5), o 14.0 (17.0), gate_up
# 77.3 (82.4), down 41.4 (45.1), LM head 333.8 (373.5); the default was within 2% of each shape's best.
DEFAULT_CONFIG = (8, 1024, 8, 3)
TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (2, 1024, 4, 3),
    (4096, 4096): (4, 512, 4, 3),
    (28672, 4096): (2, 1024, 4, 3),
    (4096, 14336): (16, 1024, 8, 2),
    # SmolLM2-135M's four layer linears, each a few µs of launch latency: more programs of fewer rows. H200
    # sweep (120 launches over 30 weight copies in one graph): 303.8 µs a step against 331.8 with the default.
    (960, 576): (2, 1024, 4, 3),
    (576, 576): (2, 1024, 4, 3),
    (3072, 576): (2, 1024, 4, 3),
    (576, 1536): (2, 1024, 4, 3),
}
# Shapes where cuBLAS's one-row kernel beats this one: SmolLM2's LM head (49152x576), 17.6 µs against 28.8 on
# an H200 (a short K leaves each program too little to read).
CUBLAS_AT_ONE_ROW: frozenset[tuple[int, int]] = frozenset({(49152, 576)})


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] (or [K]) @ weight[N, K].T (+ bias) -> [1, N] in x's dtype."""
    n, k = weight.shape
    if x.numel() != k or weight.stride(1) != 1:
        raise ValueError("gemv needs one row of K features and a weight with contiguous rows")
    flat = x.reshape(k)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    block_n, block_k, num_warps, num_stages = config or TUNED.get((n, k), DEFAULT_CONFIG)
    block_k = min(block_k, triton.next_power_of_2(k))
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        flat, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        EVEN_N=n % block_n == 0, num_warps=num_warps, num_stages=num_stages,
    )
    return y


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with one-row CUDA inputs through `gemv` and a few rows through `skinny_gemm` where its
    table says it beats cuBLAS (what the CUDA runner installs)."""
    if x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype and x.dtype != torch.float64:
        rows = x.shape[0]
        if rows == 1:
            if tuple(weight.shape) in CUBLAS_AT_ONE_ROW:
                return F.linear(x, weight, bias)
            return gemv(x, weight, bias)
        if rows <= skinny_gemm.MAX_ROWS and x.dtype != torch.float32:
            config = skinny_gemm.config_for(rows, *weight.shape)
            if config is not None:
                return skinny_gemm.skinny_gemm(x, weight, bias, config=config)
    return F.linear(x, weight, bias)
