"""Paged prefill / chunked-prefill attention over variable-length sequences with a cached prefix.

One program owns a tile of ``BLOCK_Q`` consecutive new tokens of one sequence and one KV head,
with all query heads of that head's GQA group packed into the tile's rows
(``BLOCK_M = BLOCK_Q * BLOCK_G``), so every K/V tile is loaded once per group. Tiles are
numbered per sequence from ``cu_seqlens_q[s] // BLOCK_Q + s`` (a bound that grows with s), so
the grid ``cdiv(T, BLOCK_Q) + num_seqs`` comes from shapes alone and each program finds its
sequence by binary search: no host sync, CUDA-graph capturable. Decode rows (q_len 1) are just
short sequences, so one launch can serve a mixed prefill + decode batch; but each takes a whole
tile, so where a step has many, the decode kernel attends them instead (``skip_single_rows``).
Layout and metadata are those of ``paged_attention_reference``.
"""

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    low = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + middle) // BLOCK_Q + middle
        if first_tile <= tile:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def _attend_tiles(
    acc,
    running_max,
    running_sum,
    query,
    positions,
    key_cache_ptr,
    value_cache_ptr,
    block_table,
    head_offset,
    first_token,
    last_token,
    head_dim,
    cache_block_stride,
    cache_slot_stride,
    scale_log2,
    CAUSAL: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax over keys [first_token, last_token). Without CAUSAL the range must be whole
    tiles visible to every row, so no token masking is needed."""
    dims = tl.arange(0, BLOCK_D)
    for tile_start in range(first_token, last_token, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        if CAUSAL:
            token_mask = tokens < last_token
            blocks = tl.load(block_table + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
            kv_mask = token_mask[:, None] & (dims < head_dim)[None, :]
        else:
            blocks = tl.load(block_table + tokens // PAGE_SIZE).to(tl.int64)
            kv_mask = (dims < head_dim)[None, :]
        rows = blocks * cache_block_stride + (tokens % PAGE_SIZE) * cache_slot_stride + head_offset
        key = tl.load(key_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION)
        if CAUSAL:
            visible = (tokens[None, :] <= positions[:, None]) & token_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        # Scale inside the exponent so that scaling and max-subtraction fuse into one FMA.
        new_max = tl.maximum(running_max, tl.max(scores, axis=1) * scale_log2)
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores * scale_log2 - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        value = tl.load(value_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(probs.to(value.dtype), value, input_precision=DOT_PRECISION)
        running_max = new_max
    return acc, running_max, running_sum


# Triton specializes integer arguments on ==1 and divisibility by 16: the batch's sequence count and its
# block-table width change from step to step, and each new combination compiled a new kernel in the middle of
# serving (most of the engine core's CPU time under many tiny requests). They are plain runtime values here.
@triton.jit(do_not_specialize=["num_seqs", "block_table_stride"])
def _prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    num_seqs,
    head_dim,
    query_token_stride,
    query_head_stride,
    out_token_stride,
    out_head_stride,
    block_table_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    PAGE_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SKIP_SINGLE_ROWS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    first_q = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    last_q = q_len
    if SKIP_SINGLE_ROWS:  # the decode kernel attends those
        last_q = tl.where(q_len == 1, 0, q_len)
    if first_q < last_q:
        seq_len = tl.load(seq_lens_ptr + seq)
        num_cached = seq_len - q_len

        rows = tl.arange(0, BLOCK_Q * BLOCK_G)
        q_index = first_q + rows // BLOCK_G
        group = rows % BLOCK_G
        q_heads = kv_head * QUERIES_PER_KV + group
        positions = num_cached + q_index
        dims = tl.arange(0, BLOCK_D)
        row_valid = (q_index < q_len) & (group < QUERIES_PER_KV)
        io_mask = row_valid[:, None] & (dims < head_dim)[None, :]
        q_tokens = (q_begin + q_index).to(tl.int64)
        query = tl.load(
            query_ptr + q_tokens[:, None] * query_token_stride + q_heads[:, None] * query_head_stride + dims[None, :],
            mask=io_mask,
            other=0.0,
        )

        running_max = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], dtype=tl.float32)
        block_table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
        head_offset = kv_head.to(tl.int64) * cache_head_stride
        # Keys before the tile's first query position are visible to every row: no causal mask.
        unmasked_end = (num_cached + first_q) // BLOCK_N * BLOCK_N
        visible_end = tl.minimum(seq_len, num_cached + first_q + BLOCK_Q)
        acc, running_max, running_sum = _attend_tiles(
            acc, running_max, running_sum, query, positions, key_cache_ptr, value_cache_ptr, block_table,
            head_offset, 0, unmasked_end, head_dim, cache_block_stride, cache_slot_stride,
            scale_log2, False, PAGE_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION,
        )  # fmt: skip
        acc, running_max, running_sum = _attend_tiles(
            acc, running_max, running_sum, query, positions, key_cache_ptr, value_cache_ptr, block_table,
            head_offset, unmasked_end, visible_end, head_dim, cache_block_stride, cache_slot_stride,
            scale_log2, True, PAGE_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION,
        )  # fmt: skip
        safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
        tl.store(
            out_ptr + q_tokens[:, None] * out_token_stride + q_heads[:, None] * out_head_stride + dims[None, :],
            (acc / safe_sum[:, None]).to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    skip_single_rows: bool = False,
) -> torch.Tensor:
    """Causal attention of the new tokens ``query [T, Hq, D]`` (sequence ``s`` owns rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` at positions ending at ``seq_lens[s] - 1``) over each
    sequence's paged K/V. ``skip_single_rows``: sequences with one new token are left alone
    (their rows of ``out`` untouched: ``paged_decode_attention`` attends them). ``block_m`` (rows
    per tile, query heads of a group packed in), ``block_n``, ``num_warps``, ``num_stages`` are
    tuning knobs."""
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1 or query.stride(2) != 1:
        raise ValueError("paged_prefill_attention needs matching caches with head_dim contiguous")
    out = torch.empty_like(query) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = num_q_heads // num_kv_heads
    block_g = triton.next_power_of_2(queries_per_kv)
    block_q = max(1, block_m // block_g)
    if block_q * block_g < 16:
        block_q = 16 // block_g
    grid = (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        scale * LOG2_E,
        num_seqs,
        head_dim,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        PAGE_SIZE=block_size,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SKIP_SINGLE_ROWS=skip_single_rows,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
