"""The Triton programs of the multi-LoRA op; ``lora_triton`` launches them and documents the scheme.

A tile is up to BLOCK_M tokens of one slot (one row of ``meta.tile_table``). Column c of
a shrink result is rank c % R_PAD of slice c // R_PAD; the float32 partials of shrink
program (tile, k) live at partial[tile, k, BLOCK_M, RANK_COLS].
"""

import triton
import triton.language as tl


@triton.jit
def _publish(probe, PTX: tl.constexpr):
    """Make this program's stores visible GPU-wide before one thread signals a counter.

    A barrier orders the threads of one program only at block scope, so every thread
    fences its own stores first (the split-K race NVIDIA/Fuser#2391 fixed the same way).
    ``probe`` is any small tensor: an elementwise op on it runs in every thread.
    """
    if PTX:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [probe], dtype=tl.int32, is_pure=False, pack=1
        )
    tl.debug_barrier()


@triton.jit
def _back_off(probe, PTX: tl.constexpr):
    """Pause between polls, so waiting programs do not crowd the counters the shrinkers update."""
    if PTX:
        tl.inline_asm_elementwise(
            "nanosleep.u32 128;\n\tmov.u32 $0, $1;", "=r,r", [probe], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _load_tile(tile_table_ptr, tile, BLOCK_M: tl.constexpr):
    """Slot and token rows of a tile in one round trip (slot -1: padding tile; token -1: no row)."""
    row = tile_table_ptr + tile * (BLOCK_M + 1)
    slot = tl.load(row)
    tokens = tl.load(row + 1 + tl.arange(0, BLOCK_M))
    m_mask = tokens >= 0
    return slot, tl.where(m_mask, tokens, 0).to(tl.int64), m_mask


@triton.jit
def shrink_tile(
    x_ptr, a_ptr, ranks_ptr, slot, tokens, m_mask, k_begin, in_features, stride_xm, stride_as, stride_ai, stride_ar,
    NUM_SLICES: tl.constexpr, R_PAD: tl.constexpr, RANK_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    RANK_MASKED_LOADS: tl.constexpr, R_MAX: tl.constexpr,
):
    """One tile's rows (one adapter `slot`) @ that adapter's A rows of every slice over input features
    [k_begin, k_begin + SPLIT_K): float32 [BLOCK_M, RANK_COLS], column c = slice c // R_PAD, rank
    c % R_PAD (columns past a slice's rank are zero)."""
    offs_c = tl.arange(0, RANK_COLS)
    c_slice = offs_c // R_PAD
    c_rank = offs_c % R_PAD
    c_valid = c_slice < NUM_SLICES
    ranks = tl.load(ranks_ptr + slot * NUM_SLICES + c_slice, mask=c_valid, other=0)
    c_mask = c_valid & (c_rank < ranks)
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + c_slice * stride_ai + c_rank * stride_ar
    acc = tl.zeros([BLOCK_M, RANK_COLS], dtype=tl.float32)
    for kk in range(0, SPLIT_K, BLOCK_K):
        offs_k = k_begin + kk + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_features
        x_tile = tl.load(
            x_ptr + tokens[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :], other=0.0,
        )
        if RANK_MASKED_LOADS:  # rows past a rank move no bytes, but the load waits for the ranks
            a_tile = tl.load(a_rows[None, :] + offs_k[:, None], mask=c_mask[None, :] & k_mask[:, None], other=0.0)
        else:  # no wait for the ranks; padding rows are read, then dropped (never trusted to be zero)
            a_tile = tl.load(a_rows[None, :] + offs_k[:, None],
                             mask=(c_valid & (c_rank < R_MAX))[None, :] & k_mask[:, None], other=0.0)
            a_tile = tl.where(c_mask[None, :], a_tile, 0.0)
        acc += tl.dot(x_tile, a_tile, input_precision=INPUT_PRECISION)
    return acc, offs_c, c_slice, c_rank, c_mask


@triton.jit
def shrink_program(
    pid, x_ptr, a_ptr, ranks_ptr, out_ptr, sync_ptr, tile_table_ptr,
    in_features, stride_xm, stride_out, out_slice_stride, stride_as, stride_ai, stride_ar,
    NUM_SLICES: tl.constexpr, R_PAD: tl.constexpr, RANK_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, K_SPLITS: tl.constexpr,
    TO_TOKENS: tl.constexpr, SIGNAL: tl.constexpr, PTX: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    RANK_MASKED_LOADS: tl.constexpr, R_MAX: tl.constexpr,
):
    tile = pid // K_SPLITS
    k_split = pid % K_SPLITS
    slot, tokens, m_mask = _load_tile(tile_table_ptr, tile, BLOCK_M)
    if slot >= 0:
        offs_m = tl.arange(0, BLOCK_M)
        acc, offs_c, c_slice, c_rank, c_mask = shrink_tile(
            x_ptr, a_ptr, ranks_ptr, slot, tokens, m_mask, k_split * SPLIT_K, in_features, stride_xm,
            stride_as, stride_ai, stride_ar, NUM_SLICES, R_PAD, RANK_COLS, BLOCK_M, BLOCK_K, SPLIT_K,
            INPUT_PRECISION, RANK_MASKED_LOADS, R_MAX)
        if TO_TOKENS:  # the standalone shrink (one K split): rows go to their tokens' places
            out_ptrs = out_ptr + tokens[:, None] * stride_out + (c_slice * out_slice_stride + c_rank)[None, :]
            tl.store(out_ptrs, acc, mask=m_mask[:, None] & c_mask[None, :])
        else:
            offs_p = ((tile * K_SPLITS + k_split) * BLOCK_M + offs_m[:, None]) * RANK_COLS + offs_c[None, :]
            tl.store(out_ptr + offs_p, acc)
            if SIGNAL:
                _publish(offs_m, PTX)
                tl.atomic_add(sync_ptr + tile, 1, sem="release")


@triton.jit
def expand_program(
    pid, y_ptr, b_ptr, ranks_ptr, scalings_ptr, in_ptr, sync_ptr, max_tiles, tile_table_ptr,
    stride_ym, stride_in, in_slice_stride, stride_bs, stride_bn,
    NUM_SLICES: tl.constexpr, OUT0: tl.constexpr, OUT1: tl.constexpr, OUT2: tl.constexpr,
    TILES0: tl.constexpr, TILES1: tl.constexpr, N_TILES: tl.constexpr,
    R_PAD: tl.constexpr, RANK_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_SPLITS: tl.constexpr, FROM_TOKENS: tl.constexpr, WAIT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    RANK_MASKED_LOADS: tl.constexpr, R_MAX: tl.constexpr, PTX: tl.constexpr,
):
    tile = pid // N_TILES
    j = pid % N_TILES
    slot, tokens, m_mask = _load_tile(tile_table_ptr, tile, BLOCK_M)
    if slot >= 0:
        sl = (j >= TILES0).to(tl.int32) + (j >= TILES0 + TILES1).to(tl.int32)
        slice_start = tl.where(sl == 0, 0, tl.where(sl == 1, OUT0, OUT0 + OUT1))
        slice_end = slice_start + tl.where(sl == 0, OUT0, tl.where(sl == 1, OUT1, OUT2))
        first_tile = tl.where(sl == 0, 0, tl.where(sl == 1, TILES0, TILES0 + TILES1))
        offs_n = slice_start + (j - first_tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < slice_end
        rank = tl.load(ranks_ptr + slot * NUM_SLICES + sl)
        scale = tl.load(scalings_ptr + slot * NUM_SLICES + sl)
        offs_m = tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, R_PAD)
        r_mask = offs_r < rank
        # Loads that do not depend on the shrink result go first, to overlap the wait.
        b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None]
        if RANK_MASKED_LOADS:
            b_tile = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        else:
            b_tile = tl.load(b_ptrs, mask=(offs_r < R_MAX)[:, None] & n_mask[None, :], other=0.0)
            b_tile = tl.where(r_mask[:, None], b_tile, 0.0)
        y_ptrs = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :]
        # A slice this slot does not adapt (rank 0) moves no bytes of y either.
        y_mask = m_mask[:, None] & (offs_n < tl.where(rank > 0, slice_end, 0))[None, :]
        y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0)
        if WAIT:
            while tl.atomic_add(sync_ptr + tile, 0, sem="acquire") < K_SPLITS:
                _back_off(offs_m, PTX)
            tl.debug_barrier()
        s_mask = m_mask[:, None] & r_mask[None, :]
        if FROM_TOKENS:
            s = tl.load(in_ptr + tokens[:, None] * stride_in + (sl * in_slice_stride + offs_r)[None, :], mask=s_mask,
                        other=0.0)
        else:
            s = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
            offs_p = (tile * K_SPLITS * BLOCK_M + offs_m[:, None]) * RANK_COLS + (sl * R_PAD + offs_r)[None, :]
            for k in range(K_SPLITS):
                # .cg: written by other programs of this launch; L1 is not coherent across SMs.
                s += tl.load(in_ptr + offs_p + k * BLOCK_M * RANK_COLS, mask=s_mask, other=0.0,
                             cache_modifier=".cg")
        if WAIT:
            # Past the wait: the tile's last program through it zeroes the counters for the next launch.
            ticket = tl.atomic_add(sync_ptr + max_tiles + tile, 1, sem="relaxed")
            if ticket == N_TILES - 1:
                tl.atomic_xchg(sync_ptr + tile, 0, sem="relaxed")
                tl.atomic_xchg(sync_ptr + max_tiles + tile, 0, sem="relaxed")
        s = (s * scale).to(b_ptr.dtype.element_ty)
        acc = tl.dot(s, b_tile, input_precision=INPUT_PRECISION)
        tl.store(y_ptrs, (y_tile.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def lora_kernel(
    x_ptr, y_ptr, a_ptr, b_ptr, ranks_ptr, scalings_ptr, mid_ptr, sync_ptr, tile_table_ptr,
    max_tiles, in_features, stride_xm, stride_ym, stride_mid, mid_slice_stride,
    stride_as, stride_ai, stride_ar, stride_bs, stride_bn,
    NUM_SLICES: tl.constexpr, OUT0: tl.constexpr, OUT1: tl.constexpr, OUT2: tl.constexpr,
    TILES0: tl.constexpr, TILES1: tl.constexpr, N_TILES: tl.constexpr,
    R_PAD: tl.constexpr, RANK_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_SPLITS: tl.constexpr,
    DO_SHRINK: tl.constexpr, DO_EXPAND: tl.constexpr, TOKEN_IO: tl.constexpr,
    PTX: tl.constexpr, INPUT_PRECISION: tl.constexpr, RANK_MASKED_LOADS: tl.constexpr, R_MAX: tl.constexpr,
):
    """Shrink programs first (ids below max_tiles * K_SPLITS), then expand programs."""
    pid = tl.program_id(0)
    num_shrink = max_tiles * K_SPLITS if DO_SHRINK else 0
    if DO_SHRINK:  # noqa: SIM102 (Triton cannot `and` a constexpr with a tensor)
        if pid < num_shrink:
            shrink_program(
                pid, x_ptr, a_ptr, ranks_ptr, mid_ptr, sync_ptr, tile_table_ptr,
                in_features, stride_xm, stride_mid, mid_slice_stride, stride_as, stride_ai, stride_ar,
                NUM_SLICES, R_PAD, RANK_COLS, BLOCK_M, BLOCK_K, SPLIT_K, K_SPLITS,
                TOKEN_IO, DO_EXPAND, PTX, INPUT_PRECISION, RANK_MASKED_LOADS, R_MAX,
            )
    if DO_EXPAND:  # noqa: SIM102
        if pid >= num_shrink:
            expand_program(
                pid - num_shrink, y_ptr, b_ptr, ranks_ptr, scalings_ptr, mid_ptr, sync_ptr, max_tiles, tile_table_ptr,
                stride_ym, stride_mid, mid_slice_stride, stride_bs, stride_bn,
                NUM_SLICES, OUT0, OUT1, OUT2, TILES0, TILES1, N_TILES, R_PAD, RANK_COLS, BLOCK_M, BLOCK_N,
                K_SPLITS, TOKEN_IO, DO_SHRINK, INPUT_PRECISION, RANK_MASKED_LOADS, R_MAX, PTX,
            )


@triton.jit
def noop_kernel(ptr):
    """An empty launch: the benchmark's measure of one kernel launch."""
    tl.store(ptr + tl.program_id(0), 0)
