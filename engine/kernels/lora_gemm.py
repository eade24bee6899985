"""Decode-sized linear with its multi-LoRA delta in one launch: y = x @ W.T + LoRA(x).

At decode (a few dozen rows) the separate LoRA kernel after each GEMM costs ~10 us of
latency-bound work per linear (shrink -> counter -> expand, and y read and written again),
128 launches a step for a Llama-8B. Here one launch does both:

- shrink programs (ids below ``max_tiles * K_SPLITS``), one per (tile, K split) of the
  metadata's slot-sorted tiles: x rows of the tile @ the slot's A rows of every slice, float32
  partials stored per token, then a release on one counter;
- GEMM programs, one per BLOCK_N output columns (all rows in one BLOCK_M tile): the base
  product over the whole K, rounded to y's dtype as a plain GEMM would; then (the shrink
  programs were dispatched first and finished long before the main loop ends) they acquire
  the counter, sum the row's partials, scale and round them like the reference does, and add
  ``s @ B.T`` for the batch's adapter groups, G_CHUNK groups per dot: y is written once.

Each output block lies in one slice (BLOCK_N divides every slice size), so the slice, its
ranks and scalings are per program. The last GEMM program past the wait zeroes the counter
for the next launch, as ``lora_triton`` does. Grid sizes depend only on shapes: CUDA-graph safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from loraplex.engine.kernels.lora_metadata import LoRAMetadata
from loraplex.engine.kernels.lora_triton import rank_pad
from loraplex.engine.kernels.lora_triton_programs import _back_off, _load_tile, _publish, shrink_tile
from loraplex.engine.kernels.lora_weights import LoRAStack

MAX_ROWS = 64  # one BLOCK_M tile of rows; larger batches keep the GEMM + separate LoRA kernel


@dataclass(frozen=True, slots=True)
class LoRAGemmConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1024  # shrink: input features per shrink program
    shrink_block_k: int = 128
    g_chunk: int = 4  # adapter groups per epilogue dot
    gemm_splits: int = 1  # GEMM K splits per output block; the last split to finish sums them and adds the delta


# (N, K) -> config, from the H100 sweep in benchmarks/notes/gpu_engine.md (Llama-8B shapes, 64 rows, 8 adapters
# of rank 16; us per call in one launch vs cuBLAS + the separate LoRA kernel): qkv 29.7 vs 30.7, gate_up 98.7 vs
# 101.4, down 59.6 vs 61.1.
TUNED: dict[tuple[int, int], LoRAGemmConfig] = {
    (6144, 4096): LoRAGemmConfig(block_n=32, block_k=128, num_warps=4, num_stages=4, split_k=1024),
    (28672, 4096): LoRAGemmConfig(block_n=128, block_k=128, num_warps=8, num_stages=3, split_k=1024),
    (4096, 14336): LoRAGemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, split_k=2048, gemm_splits=2),
    # SmolLM2-135M (H200 sweep, 64 rows, 8 adapters of rank 16, us per call in one launch vs cuBLAS + the separate
    # LoRA kernel): qkv 8.9 vs 10.1, o 7.9 vs 8.3, gate_up 8.9 vs 9.8, down 9.9 vs 10.0. Each launch saved is a few
    # µs of latency at these narrow layers: the engine's decode step over four adapters on every projection went
    # from 1.645 / 1.648 ms to 1.472 / 1.475 at 16 rows and from 1.773 / 1.720 to 1.586 / 1.587 at 48.
    (960, 576): LoRAGemmConfig(block_n=16, block_k=64, num_warps=4, num_stages=4, split_k=1024, shrink_block_k=64),
    (576, 576): LoRAGemmConfig(block_n=16, block_k=64, num_warps=4, num_stages=4, split_k=1024, shrink_block_k=64),
    (3072, 576): LoRAGemmConfig(block_n=64, block_k=64, num_warps=4, num_stages=4, split_k=1024, shrink_block_k=64),
    (576, 1536): LoRAGemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=1024, shrink_block_k=128),
}
# (N, K) shapes measured slower in one launch than cuBLAS + the separate LoRA kernel, left to that path:
# the o projection (best 24.9 vs 22.8 us).
SEPARATE: set[tuple[int, int]] = {(4096, 4096)}
# Only shapes in TUNED take the one-launch path: elsewhere (other models) it is unmeasured and could be slower than
# the separate kernel (as o is here). The 70B's TP-4 shards were swept on the H100 and gain nothing (best one launch
# vs cuBLAS + LoRA, us: qkv 32.5 vs 32.4, gate_up 98.4 vs 96.9, down 55.3 vs 52.6, o 22.6 vs 23.2), so they keep
# the separate kernel. Tests switch this off to run it on tiny shapes.
TUNED_ONLY = True


@triton.jit
def _lora_gemm_kernel(
    x_ptr, w_ptr, y_ptr, a_ptr, b_ptr, ranks_ptr, scalings_ptr, part_ptr, sync_ptr, tile_table_ptr,
    token_slots_ptr, group_slots_ptr,
    M, N, K, max_groups, stride_xm, stride_wn, stride_ym,
    stride_as, stride_ai, stride_ar, stride_bs, stride_bn,
    ws_ptr, NUM_SHRINK: tl.constexpr, NUM_GEMM: tl.constexpr, GEMM_SPLITS: tl.constexpr, K_PER: tl.constexpr,
    HAS_LORA: tl.constexpr,
    NUM_SLICES: tl.constexpr, OUT0: tl.constexpr, OUT1: tl.constexpr,
    R_PAD: tl.constexpr, RANK_COLS: tl.constexpr, TILE_M: tl.constexpr,
    SPLIT_K: tl.constexpr, K_SPLITS: tl.constexpr, SHRINK_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G_CHUNK: tl.constexpr,
    MAX_G_PAD: tl.constexpr, EVEN_K: tl.constexpr, EVEN_M: tl.constexpr,
    PTX: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < NUM_SHRINK:
        tile = pid // K_SPLITS
        k_split = pid % K_SPLITS
        slot, tokens, t_mask = _load_tile(tile_table_ptr, tile, TILE_M)
        offs_t = tl.arange(0, TILE_M)
        if slot >= 0:
            acc, offs_c, _, _, _ = shrink_tile(
                x_ptr, a_ptr, ranks_ptr, slot, tokens, t_mask, k_split * SPLIT_K, K, stride_xm, stride_as, stride_ai,
                stride_ar, NUM_SLICES, R_PAD, RANK_COLS, TILE_M, SHRINK_BK, SPLIT_K, INPUT_PRECISION, True, R_PAD)
            part = part_ptr + (k_split * BLOCK_M + tokens[:, None]) * RANK_COLS + offs_c[None, :]
            tl.store(part, acc, mask=t_mask[:, None])
        _publish(offs_t, PTX)
        tl.atomic_add(sync_ptr, 1, sem="release")
    else:
        pid_g = pid - NUM_SHRINK
        pid_n = pid_g // GEMM_SPLITS
        k_part = pid_g % GEMM_SPLITS
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_begin = k_part * K_PER
        for k in range(k_begin, k_begin + K_PER, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :])
                if EVEN_M:
                    xt = tl.load(x_rows + offs_k[None, :])
                else:
                    xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            else:
                k_mask = offs_k < K
                w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
                xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(xt, tl.trans(w), acc, input_precision=INPUT_PRECISION)
        last = True
        if GEMM_SPLITS > 1:
            # Split K: every split stores its float32 tile; the last one to arrive sums all of them in
            # split order (deterministic whichever arrives last) and finishes the block.
            tile_off = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(ws_ptr + (pid_g * BLOCK_M * BLOCK_N) + tile_off, acc)
            _publish(offs_m, PTX)
            ticket = tl.atomic_add(sync_ptr + 2 + pid_n, 1, sem="acq_rel")
            last = ticket == GEMM_SPLITS - 1
            if last:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in range(GEMM_SPLITS):
                    acc += tl.load(ws_ptr + ((pid_n * GEMM_SPLITS + j) * BLOCK_M * BLOCK_N) + tile_off,
                                   cache_modifier=".cg")
                tl.atomic_xchg(sync_ptr + 2 + pid_n, 0, sem="relaxed")
        if last:
            out = _finish_block(acc, y_ptr, b_ptr, ranks_ptr, scalings_ptr, part_ptr, sync_ptr, token_slots_ptr,
                                group_slots_ptr, M, max_groups, stride_ym, stride_bs, stride_bn, offs_m, m_mask, n0,
                                offs_n, NUM_SHRINK, NUM_GEMM, NUM_SLICES, OUT0, OUT1, R_PAD, RANK_COLS, K_SPLITS,
                                BLOCK_M, BLOCK_N, G_CHUNK, MAX_G_PAD, PTX, INPUT_PRECISION, HAS_LORA)
            y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
            if EVEN_M:
                tl.store(y_ptrs, out)
            else:
                tl.store(y_ptrs, out, mask=m_mask[:, None])


@triton.jit
def _finish_block(acc, y_ptr, b_ptr, ranks_ptr, scalings_ptr, part_ptr, sync_ptr, token_slots_ptr, group_slots_ptr,
                  M, max_groups, stride_ym, stride_bs, stride_bn, offs_m, m_mask, n0, offs_n,
                  NUM_SHRINK: tl.constexpr, NUM_GEMM: tl.constexpr, NUM_SLICES: tl.constexpr, OUT0: tl.constexpr,
                  OUT1: tl.constexpr, R_PAD: tl.constexpr, RANK_COLS: tl.constexpr, K_SPLITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G_CHUNK: tl.constexpr, MAX_G_PAD: tl.constexpr,
                  PTX: tl.constexpr, INPUT_PRECISION: tl.constexpr, HAS_LORA: tl.constexpr):
    """The block's output in y's dtype: the base product rounded as a plain GEMM would, plus the delta."""
    base = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    delta = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HAS_LORA:
        # Every shrink program has signalled (they came first and are short); the last through resets.
        while tl.atomic_add(sync_ptr, 0, sem="acquire") < NUM_SHRINK:
            _back_off(offs_m, PTX)
        tl.debug_barrier()
        ticket = tl.atomic_add(sync_ptr + 1, 1, sem="relaxed")
        if ticket == NUM_GEMM - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed")

        sl = (n0 >= OUT0).to(tl.int32) + (n0 >= OUT0 + OUT1).to(tl.int32)
        row_slot = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1)
        offs_r = tl.arange(0, R_PAD)
        # The row's own shrink result for this slice, summed over K splits (rows without an adapter: 0).
        s_ptrs = part_ptr + offs_m[:, None] * RANK_COLS + (sl * R_PAD + offs_r)[None, :]
        s_mask = (row_slot >= 0)[:, None] & (offs_r < R_PAD)[None, :]
        s = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
        for ks in range(K_SPLITS):
            # .cg: written by other programs of this launch; L1 is not coherent across SMs.
            s += tl.load(s_ptrs + ks * BLOCK_M * RANK_COLS, mask=s_mask, other=0.0, cache_modifier=".cg")
        all_groups = tl.load(group_slots_ptr + tl.arange(0, MAX_G_PAD), mask=tl.arange(0, MAX_G_PAD) < max_groups,
                             other=-1)
        num_groups = tl.sum((all_groups >= 0).to(tl.int32), axis=0)
        offs_g = tl.arange(0, G_CHUNK)
        for g0 in range(0, num_groups, G_CHUNK):
            gslot = tl.load(group_slots_ptr + g0 + offs_g, mask=g0 + offs_g < num_groups, other=-1)
            g_ok = gslot >= 0
            gslot_safe = tl.where(g_ok, gslot, 0)
            grank = tl.load(ranks_ptr + gslot_safe * NUM_SLICES + sl, mask=g_ok, other=0)
            gscale = tl.load(scalings_ptr + gslot_safe * NUM_SLICES + sl, mask=g_ok, other=0.0)
            gr_mask = (offs_r[None, :] < grank[:, None])  # [G, R]: columns past a rank are never read
            # s3[m, g, r]: the row's s where the row belongs to group g, scaled, rounded as the reference does
            in_group = (row_slot[:, None] == gslot[None, :]) & g_ok[None, :]  # [M, G]
            s3 = tl.where(in_group[:, :, None] & gr_mask[None, :, :], s[:, None, :] * gscale[None, :, None], 0.0)
            s2 = tl.reshape(s3.to(b_ptr.dtype.element_ty), [BLOCK_M, G_CHUNK * R_PAD])
            b_ptrs = (b_ptr + gslot_safe.to(tl.int64)[:, None, None] * stride_bs
                      + offs_n[None, :, None] * stride_bn + offs_r[None, None, :])  # [G, BLOCK_N, R]
            b3 = tl.load(b_ptrs, mask=gr_mask[:, None, :], other=0.0)
            b2 = tl.reshape(tl.permute(b3, (0, 2, 1)), [G_CHUNK * R_PAD, BLOCK_N])
            delta = tl.dot(s2, b2, delta, input_precision=INPUT_PRECISION)
    return (base + delta).to(y_ptr.dtype.element_ty)


def _block_n(stack: LoRAStack, n: int, wanted: int) -> int | None:
    """The widest power of two <= wanted dividing every slice (each program in one slice), >= 16."""
    g = 0
    for size in stack.out_sizes:
        g = math.gcd(g, size)
    g = math.gcd(g, n)
    block = wanted
    while block >= 16:
        if g % block == 0:
            return block
        block //= 2
    return None


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stack: LoRAStack,
             meta: LoRAMetadata) -> bool:
    return (
        x.is_cuda and bias is None and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
        and x.shape[0] == meta.num_tokens and x.stride(-1) == 1 and weight.stride(-1) == 1
        and x.dtype == weight.dtype == stack.lora_a.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.shape[0] == stack.out_features and weight.shape[1] == stack.in_features
        and _block_n(stack, weight.shape[0], 16) is not None and tuple(weight.shape) not in SEPARATE
        and (tuple(weight.shape) in TUNED or not TUNED_ONLY)
    )


def linear_with_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    stack: LoRAStack,
    meta: LoRAMetadata,
    *,
    config: LoRAGemmConfig | None = None,
    out: torch.Tensor | None = None,
    has_lora: bool = True,
) -> torch.Tensor:
    """x [M <= 64, K] @ weight[N, K].T plus every row's LoRA delta (slot -1: none) -> [M, N] in x's dtype.
    has_lora=False: the plain product through the same GEMM (the benchmark's measure of its base cost)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or m != meta.num_tokens or k != stack.in_features or n != stack.out_features:
        raise ValueError("linear_with_lora: shapes do not match the stack and metadata")
    config = config or TUNED.get((n, k), LoRAGemmConfig())
    block_n = _block_n(stack, n, config.block_n)
    if block_n is None:
        raise ValueError("no output block divides every slice")
    block_m = max(16, triton.next_power_of_2(m))
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    r_pad = rank_pad(stack.max_rank)
    rank_cols = triton.next_power_of_2(stack.num_slices * r_pad)
    split_k = min(max(config.split_k, config.shrink_block_k), triton.cdiv(k, config.shrink_block_k) * config.shrink_block_k)
    k_splits = triton.cdiv(k, split_k)
    num_shrink = meta.max_tiles * k_splits if has_lora else 0
    num_gemm = n // block_n
    gemm_splits = config.gemm_splits if num_gemm + 2 <= meta.sync.shape[0] else 1
    k_per = triton.cdiv(triton.cdiv(k, gemm_splits), block_k) * block_k
    gemm_splits = triton.cdiv(k, k_per)
    max_groups = meta.group_slots.shape[0]
    partials = torch.empty(k_splits * block_m * rank_cols, dtype=torch.float32, device=x.device)
    workspace = (torch.empty(num_gemm * gemm_splits * block_m * block_n, dtype=torch.float32, device=x.device)
                 if gemm_splits > 1 else partials)
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    sizes = (*stack.out_sizes, 0, 0)[:3]
    _lora_gemm_kernel[(num_shrink + num_gemm * gemm_splits,)](
        x, weight, y, stack.lora_a, stack.lora_b, stack.ranks, stack.scalings, partials, meta.sync,
        meta.tile_table, meta.token_slots, meta.group_slots,
        m, n, k, max_groups, x.stride(0), weight.stride(0), y.stride(0),
        stack.lora_a.stride(0), stack.lora_a.stride(1), stack.lora_a.stride(2),
        stack.lora_b.stride(0), stack.lora_b.stride(1),
        workspace, NUM_SHRINK=num_shrink, NUM_GEMM=num_gemm, GEMM_SPLITS=gemm_splits, K_PER=k_per, HAS_LORA=has_lora,
        NUM_SLICES=stack.num_slices, OUT0=sizes[0], OUT1=sizes[1],
        R_PAD=r_pad, RANK_COLS=rank_cols, TILE_M=meta.block_m,
        SPLIT_K=split_k, K_SPLITS=k_splits, SHRINK_BK=config.shrink_block_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, G_CHUNK=config.g_chunk,
        MAX_G_PAD=triton.next_power_of_2(max_groups), EVEN_K=k % block_k == 0 and k % k_per == 0, EVEN_M=m == block_m,
        PTX=x.is_cuda, INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y
