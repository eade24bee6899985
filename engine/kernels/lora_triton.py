"""Triton multi-LoRA kernels: shrink (x @ A.T), expand (y += scale * s @ B.T), and both fused.

One kernel serves all three. Its programs come in two ranges of ``program_id``:

- shrink programs, one per (tile, K split): a tile is up to ``block_m`` tokens of one slot
  (see ``lora_metadata``); each reads its K slice of those tokens' x rows and of the slot's
  A rows of every slice of the layer, up to each slice's rank. With several K splits the
  last to finish (a per-tile ticket) sums the float32 partials; the tile's shrink result
  goes to a [T, num_slices * max_rank] float32 buffer;
- expand programs, one per (tile, BLOCK_N columns of one output slice): each reads the
  slot's B columns and the y tile, then the shrink result, and adds the product into y.

Fused, both ranges run in one launch: expand programs come after every shrink program
in launch order, prefetch B and y, then wait on the tile's counter. Waiting only on
programs with a lower id is the "decoupled look-back" pattern: those were dispatched
first, so they make progress. The last expand program of a tile zeroes its counters,
so ``meta.sync`` is zero again for the next layer. Grids depend on (num_tokens,
max_loras, block_m) and the layer's shapes only, never on content: CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from loraplex.engine.kernels.lora_metadata import LoRAMetadata
from loraplex.engine.kernels.lora_weights import LoRAStack


@dataclass(frozen=True, slots=True)
class LoRAKernelConfig:
    block_n: int
    split_k: int  # input features per shrink program
    block_k: int
    num_warps: int
    fused: bool = True  # one launch; False runs shrink then expand (two launches)


def choose_config(stack: LoRAStack, meta: LoRAMetadata) -> LoRAKernelConfig:
    rank_cols = triton.next_power_of_2(stack.num_slices * _rank_pad(stack.max_rank))
    block_k = 64 if rank_cols * meta.block_m > 64 * 64 else 128
    split_k = max(block_k, min(512, triton.next_power_of_2(stack.in_features) // 4))
    return LoRAKernelConfig(block_n=128, split_k=split_k, block_k=block_k, num_warps=4)


def _rank_pad(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))  # tl.dot needs every dimension >= 16


@triton.jit
def _publish(probe, FENCE: tl.constexpr):
    """Make this program's stores visible GPU-wide before one thread signals a counter.

    A barrier orders the threads of one program only at block scope, so every thread
    fences its own stores first (the split-K race NVIDIA/Fuser#2391 fixed the same way).
    ``probe`` is any small tensor: an elementwise op on it runs in every thread.
    """
    if FENCE:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [probe], dtype=tl.int32, is_pure=False, pack=1
        )
    tl.debug_barrier()


@triton.jit
def _shrink_program(
    pid, x_ptr, a_ptr, ranks_ptr, shrunk_ptr, partial_ptr, sync_ptr,
    token_ids_ptr, tile_slots_ptr, tile_starts_ptr, tile_lens_ptr,
    in_features, stride_xm, stride_shrunk, shrunk_slice_stride,
    stride_as, stride_ai, stride_ar,
    NUM_SLICES: tl.constexpr, R_PAD: tl.constexpr, RANK_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, K_SPLITS: tl.constexpr,
    SIGNAL: tl.constexpr, FENCE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    tile = pid // K_SPLITS
    k_split = pid % K_SPLITS
    slot = tl.load(tile_slots_ptr + tile)
    if slot >= 0:
        start = tl.load(tile_starts_ptr + tile)
        length = tl.load(tile_lens_ptr + tile)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < length
        tokens = tl.load(token_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        # Column c of the shrink result is rank c % R_PAD of slice c // R_PAD.
        offs_c = tl.arange(0, RANK_COLS)
        c_slice = offs_c // R_PAD
        c_rank = offs_c % R_PAD
        c_valid = c_slice < NUM_SLICES
        ranks = tl.load(ranks_ptr + slot * NUM_SLICES + c_slice, mask=c_valid, other=0)
        c_mask = c_valid & (c_rank < ranks)
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + c_slice * stride_ai + c_rank * stride_ar
        acc = tl.zeros([BLOCK_M, RANK_COLS], dtype=tl.float32)
        k_begin = k_split * SPLIT_K
        for kk in range(0, SPLIT_K, BLOCK_K):
            offs_k = k_begin + kk + tl.arange(0, BLOCK_K)
            k_mask = offs_k < in_features
            x_tile = tl.load(
                x_ptr + tokens[:, None] * stride_xm + offs_k[None, :],
                mask=m_mask[:, None] & k_mask[None, :], other=0.0,
            )
            a_tile = tl.load(a_rows[None, :] + offs_k[:, None], mask=c_mask[None, :] & k_mask[:, None], other=0.0)
            acc += tl.dot(x_tile, a_tile, input_precision=INPUT_PRECISION)
        out_ptrs = shrunk_ptr + tokens[:, None] * stride_shrunk + (c_slice * shrunk_slice_stride + c_rank)[None, :]
        out_mask = m_mask[:, None] & c_mask[None, :]
        if K_SPLITS == 1:
            tl.store(out_ptrs, acc, mask=out_mask)
            if SIGNAL:
                _publish(offs_m, FENCE)
                tl.atomic_add(sync_ptr + tile, 1, sem="release")
        else:
            offs_p = (tile * K_SPLITS * BLOCK_M + offs_m[:, None]) * RANK_COLS + offs_c[None, :]
            tl.store(partial_ptr + offs_p + k_split * BLOCK_M * RANK_COLS, acc)
            _publish(offs_m, FENCE)
            ticket = tl.atomic_add(sync_ptr + tile, 1, sem="acq_rel")
            if ticket == K_SPLITS - 1:
                total = tl.zeros([BLOCK_M, RANK_COLS], dtype=tl.float32)
                for s in range(K_SPLITS):
                    # .cg: other programs wrote these; L1 is not coherent across SMs.
                    total += tl.load(partial_ptr + offs_p + s * BLOCK_M * RANK_COLS, cache_modifier=".cg")
                tl.store(out_ptrs, total, mask=out_mask)
                _publish(offs_m, FENCE)
                if SIGNAL:
                    tl.atomic_add(sync_ptr + tile, 1, sem="release")
                else:
                    tl.atomic_xchg(sync_ptr + tile, 0)


@triton.jit
def _expand_program(
    pid, y_ptr, b_ptr, ranks_ptr, scalings_ptr, shrunk_ptr, sync_ptr, max_tiles,
    token_ids_ptr, tile_slots_ptr, tile_starts_ptr, tile_lens_ptr,
    stride_ym, stride_shrunk, shrunk_slice_stride, stride_bs, stride_bn,
    NUM_SLICES: tl.constexpr, OUT0: tl.constexpr, OUT1: tl.constexpr, OUT2: tl.constexpr,
    TILES0: tl.constexpr, TILES1: tl.constexpr, N_TILES: tl.constexpr,
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WAIT: tl.constexpr, READY: tl.constexpr, FENCE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    tile = pid // N_TILES
    j = pid % N_TILES
    slot = tl.load(tile_slots_ptr + tile)
    if slot >= 0:
        sl = (j >= TILES0).to(tl.int32) + (j >= TILES0 + TILES1).to(tl.int32)
        slice_start = tl.where(sl == 0, 0, tl.where(sl == 1, OUT0, OUT0 + OUT1))
        slice_end = slice_start + tl.where(sl == 0, OUT0, tl.where(sl == 1, OUT1, OUT2))
        first_tile = tl.where(sl == 0, 0, tl.where(sl == 1, TILES0, TILES0 + TILES1))
        offs_n = slice_start + (j - first_tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < slice_end
        rank = tl.load(ranks_ptr + slot * NUM_SLICES + sl)
        scale = tl.load(scalings_ptr + slot * NUM_SLICES + sl)
        start = tl.load(tile_starts_ptr + tile)
        length = tl.load(tile_lens_ptr + tile)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < length
        tokens = tl.load(token_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, R_PAD)
        r_mask = offs_r < rank
        # Loads that do not depend on the shrink result go first, to overlap the wait.
        b_tile = tl.load(
            b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
            mask=r_mask[:, None] & n_mask[None, :], other=0.0,
        )
        y_ptrs = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :]
        # A slice this slot does not adapt (rank 0) moves no bytes of y either.
        y_n_mask = offs_n < tl.where(rank > 0, slice_end, 0)
        y_mask = m_mask[:, None] & y_n_mask[None, :]
        y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0)
        if WAIT:
            while tl.atomic_add(sync_ptr + tile, 0, sem="acquire") < READY:
                pass
            _publish(offs_m, FENCE)
        s = tl.load(
            shrunk_ptr + tokens[:, None] * stride_shrunk + (sl * shrunk_slice_stride + offs_r)[None, :],
            mask=m_mask[:, None] & r_mask[None, :], other=0.0, cache_modifier=".cg",
        )
        s = (s * scale).to(b_ptr.dtype.element_ty)
        acc = tl.dot(s, b_tile, input_precision=INPUT_PRECISION)
        tl.store(y_ptrs, (y_tile.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)
        if WAIT:
            _publish(offs_m, FENCE)
            ticket = tl.atomic_add(sync_ptr + max_tiles + tile, 1, sem="acq_rel")
            if ticket == N_TILES - 1:
                tl.atomic_xchg(sync_ptr + tile, 0)
                tl.atomic_xchg(sync_ptr + max_tiles + tile, 0)


@triton.jit
def _lora_kernel(
    x_ptr, y_ptr, a_ptr, b_ptr, ranks_ptr, scalings_ptr, shrunk_ptr, partial_ptr, sync_ptr,
    token_ids_ptr, tile_slots_ptr, tile_starts_ptr, tile_lens_ptr,
    max_tiles, in_features, stride_xm, stride_ym, stride_shrunk, shrunk_slice_stride,
    stride_as, stride_ai, stride_ar, stride_bs, stride_bn,
    NUM_SLICES: tl.constexpr, OUT0: tl.constexpr, OUT1: tl.constexpr, OUT2: tl.constexpr,
    TILES0: tl.constexpr, TILES1: tl.constexpr, N_TILES: tl.constexpr,
    R_PAD: tl.constexpr, RANK_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_SPLITS: tl.constexpr,
    DO_SHRINK: tl.constexpr, DO_EXPAND: tl.constexpr, READY: tl.constexpr,
    FENCE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_shrink = max_tiles * K_SPLITS if DO_SHRINK else 0
    if DO_SHRINK:  # noqa: SIM102 (Triton cannot `and` a constexpr with a tensor)
        if pid < num_shrink:
            _shrink_program(
                pid, x_ptr, a_ptr, ranks_ptr, shrunk_ptr, partial_ptr, sync_ptr,
                token_ids_ptr, tile_slots_ptr, tile_starts_ptr, tile_lens_ptr,
                in_features, stride_xm, stride_shrunk, shrunk_slice_stride, stride_as, stride_ai, stride_ar,
                NUM_SLICES, R_PAD, RANK_COLS, BLOCK_M, BLOCK_K, SPLIT_K, K_SPLITS, DO_EXPAND, FENCE,
                INPUT_PRECISION,
            )
    if DO_EXPAND:  # noqa: SIM102
        if pid >= num_shrink:
            _expand_program(
                pid - num_shrink, y_ptr, b_ptr, ranks_ptr, scalings_ptr, shrunk_ptr, sync_ptr, max_tiles,
                token_ids_ptr, tile_slots_ptr, tile_starts_ptr, tile_lens_ptr,
                stride_ym, stride_shrunk, shrunk_slice_stride, stride_bs, stride_bn,
                NUM_SLICES, OUT0, OUT1, OUT2, TILES0, TILES1, N_TILES, R_PAD, BLOCK_M, BLOCK_N,
                DO_SHRINK, READY, FENCE, INPUT_PRECISION,
            )


def _launch(
    *,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    shrunk: torch.Tensor,
    stack: LoRAStack,
    meta: LoRAMetadata,
    config: LoRAKernelConfig,
    do_shrink: bool,
    do_expand: bool,
) -> None:
    sizes = (*stack.out_sizes, 0, 0)[:3]
    tiles = [triton.cdiv(size, config.block_n) for size in sizes]
    rank_pad = _rank_pad(stack.max_rank)
    rank_cols = triton.next_power_of_2(stack.num_slices * rank_pad)
    k_splits = triton.cdiv(stack.in_features, config.split_k)
    max_tiles = meta.max_tiles
    partial = (
        torch.empty(max_tiles * k_splits * meta.block_m * rank_cols, dtype=torch.float32, device=shrunk.device)
        if do_shrink and k_splits > 1
        else shrunk
    )
    grid = (max_tiles * k_splits * do_shrink + max_tiles * sum(tiles) * do_expand,)
    x_arg = x if x is not None else shrunk
    y_arg = y if y is not None else shrunk
    precision = "ieee" if stack.lora_a.dtype == torch.float32 else None
    _lora_kernel[grid](
        x_arg, y_arg, stack.lora_a, stack.lora_b, stack.ranks, stack.scalings, shrunk, partial, meta.sync,
        meta.sorted_token_ids, meta.tile_slots, meta.tile_starts, meta.tile_lens,
        max_tiles, stack.in_features, x_arg.stride(0), y_arg.stride(0), shrunk.stride(0), stack.max_rank,
        stack.lora_a.stride(0), stack.lora_a.stride(1), stack.lora_a.stride(2),
        stack.lora_b.stride(0), stack.lora_b.stride(1),
        NUM_SLICES=stack.num_slices, OUT0=sizes[0], OUT1=sizes[1], OUT2=sizes[2],
        TILES0=tiles[0], TILES1=tiles[1], N_TILES=sum(tiles),
        R_PAD=rank_pad, RANK_COLS=rank_cols,
        BLOCK_M=meta.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, K_SPLITS=k_splits,
        DO_SHRINK=do_shrink, DO_EXPAND=do_expand, READY=k_splits + 1 if k_splits > 1 else 1,
        FENCE=shrunk.is_cuda,  # the interpreter runs programs one by one and has no inline PTX
        INPUT_PRECISION=precision, num_warps=config.num_warps,
    )


def _check_rows(x: torch.Tensor, meta: LoRAMetadata) -> None:
    if x.shape[0] != meta.num_tokens or x.stride(-1) != 1:
        raise ValueError(f"expected {meta.num_tokens} rows with contiguous features, got {tuple(x.shape)}")


def lora_shrink(
    x: torch.Tensor, stack: LoRAStack, meta: LoRAMetadata, *, config: LoRAKernelConfig | None = None
) -> torch.Tensor:
    """[T, num_slices * max_rank] float32 = x @ A.T per token's slot; zero where no adapter or past rank."""
    _check_rows(x, meta)
    shrunk = torch.zeros(meta.num_tokens, stack.num_slices * stack.max_rank, dtype=torch.float32, device=x.device)
    config = config or choose_config(stack, meta)
    _launch(x=x, y=None, shrunk=shrunk, stack=stack, meta=meta, config=config, do_shrink=True, do_expand=False)
    return shrunk


def lora_expand(
    shrunk: torch.Tensor,
    y: torch.Tensor,
    stack: LoRAStack,
    meta: LoRAMetadata,
    *,
    config: LoRAKernelConfig | None = None,
) -> None:
    """y[:, slice i] += scaling * shrunk[:, slice i] @ B_i.T in place, for rows with an adapter."""
    _check_rows(y, meta)
    config = config or choose_config(stack, meta)
    _launch(x=None, y=y, shrunk=shrunk, stack=stack, meta=meta, config=config, do_shrink=False, do_expand=True)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    stack: LoRAStack,
    meta: LoRAMetadata,
    *,
    config: LoRAKernelConfig | None = None,
) -> None:
    """y += LoRA delta of x for every slice of the layer, each token through its slot: one launch."""
    _check_rows(x, meta)
    _check_rows(y, meta)
    config = config or choose_config(stack, meta)
    shrunk = torch.empty(meta.num_tokens, stack.num_slices * stack.max_rank, dtype=torch.float32, device=x.device)
    if config.fused:
        _launch(x=x, y=y, shrunk=shrunk, stack=stack, meta=meta, config=config, do_shrink=True, do_expand=True)
    else:
        _launch(x=x, y=None, shrunk=shrunk, stack=stack, meta=meta, config=config, do_shrink=True, do_expand=False)
        _launch(x=None, y=y, shrunk=shrunk, stack=stack, meta=meta, config=config, do_shrink=False, do_expand=True)
