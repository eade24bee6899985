"""Paged decode attention (one query per sequence), split over the KV length (FlashDecoding).

Each program owns one (sequence, KV head, split): it loads every query head of the KV head's
GQA group at once, so each K/V byte is read once per step, and keeps a running softmax over its
share of the sequence. With one split the program writes the output; otherwise it writes a
normalised partial output and its log-sum-exp, and a small second kernel merges the splits.
Grids depend only on tensor shapes and the split count, so a decode step can be captured in a
CUDA graph (the split count is chosen from shapes, never from the current lengths).

In a step that mixes prompt chunks with decodes, the decodes take this kernel too (``cu_seqlens_q``
names each sequence's rows; a sequence with other than one new token is left to the prefill
kernel): the prefill kernel gives every sequence a tile of ``BLOCK_Q`` queries, so a decode row
there computed some thirty times its one query and read its keys without splitting them.
Layout and metadata are those of ``paged_attention_reference``.
"""

from functools import cache

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def _decode_split_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    head_dim,
    query_seq_stride,
    query_head_stride,
    out_seq_stride,
    out_head_stride,
    block_table_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    PAGE_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROWS_FROM_CU: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    row = seq.to(tl.int64)
    if ROWS_FROM_CU:  # a mixed step: this sequence's one row, or none (a prompt chunk: the prefill kernel's)
        row = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
        # Any other sequence attends to nothing here, and its output rows are left alone below.
        seq_len = tl.where(tl.load(cu_seqlens_q_ptr + seq + 1) - row == 1, seq_len, 0)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    group = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    q_heads = kv_head * QUERIES_PER_KV + group
    num_live_heads = QUERIES_PER_KV
    if ROWS_FROM_CU:  # nothing read or written for a sequence this kernel leaves alone
        num_live_heads = tl.where(seq_len > 0, QUERIES_PER_KV, 0)
    row_mask = (group < num_live_heads)[:, None] & (dims < head_dim)[None, :]
    query = tl.load(
        query_ptr + row * query_seq_stride + q_heads[:, None] * query_head_stride + dims[None, :],
        mask=row_mask,
        other=0.0,
    )

    running_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    head_offset = kv_head.to(tl.int64) * cache_head_stride
    for first_token in range(start, end, BLOCK_N):
        tokens = first_token + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        blocks = tl.load(block_table + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
        rows = blocks * cache_block_stride + (tokens % PAGE_SIZE) * cache_slot_stride + head_offset
        kv_mask = token_mask[:, None] & (dims < head_dim)[None, :]
        key = tl.load(key_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        value = tl.load(value_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)

        scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(value.dtype), value, input_precision=DOT_PRECISION)
        running_max = new_max

    # An empty split (or a padded sequence of length 0) has running_sum 0 and yields zeros.
    safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
    result = acc / safe_sum[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + row * out_seq_stride + q_heads[:, None] * out_head_stride + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:
        num_q_heads = tl.num_programs(1) * QUERIES_PER_KV
        partial_rows = (seq.to(tl.int64) * num_q_heads + q_heads) * NUM_SPLITS + split
        tl.store(partial_out_ptr + partial_rows[:, None] * BLOCK_D + dims[None, :], result, mask=row_mask)
        lse = tl.where(running_sum > 0, running_max + tl.log2(safe_sum), float("-inf"))
        tl.store(partial_lse_ptr + partial_rows, lse, mask=group < QUERIES_PER_KV)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    cu_seqlens_q_ptr,
    out_ptr,
    head_dim,
    out_seq_stride,
    out_head_stride,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS_FROM_CU: tl.constexpr,
):
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    out_row = seq.to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    num_dims_stored = head_dim
    if ROWS_FROM_CU:  # only a sequence with one new row (the others' rows are the prefill kernel's)
        out_row = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
        num_dims_stored = tl.where(tl.load(cu_seqlens_q_ptr + seq + 1) - out_row == 1, head_dim, 0)
    row = seq.to(tl.int64) * tl.num_programs(1) + q_head
    splits = tl.arange(0, BLOCK_S)
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    total = tl.sum(weights, axis=0)
    total = tl.where(total > 0, total, 1.0)
    partial = tl.load(
        partial_out_ptr + (row * NUM_SPLITS + splits)[:, None] * BLOCK_D + dims[None, :],
        mask=(splits < NUM_SPLITS)[:, None] & (dims < head_dim)[None, :],
        other=0.0,
    )
    result = tl.sum(partial * weights[:, None], axis=0) / total
    tl.store(
        out_ptr + out_row * out_seq_stride + q_head * out_head_stride + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < num_dims_stored,
    )


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# (KV heads, head_dim) -> ((most sequences, splits), ...) on a card of TUNED_SPLITS_SMS SMs, where a sweep found
# the rule below too few splits (benchmarks/notes/gpu_kernels.md): a program over 3 KV heads of 64 (SmolLM2-135M)
# is light, and from 48 sequences the rule's two programs an SM leave each one a long serial loop over the KV.
# H200, bf16, µs per call at 192 / 640 / 2048 tokens of context, 48 sequences: rule (2 splits) 7.2 / 15.9 / 36.9,
# 4 splits 7.0 / 13.7 / 27.7; 64 sequences 7.6 / 17.1 / 39.0 against 7.9 / 15.2 / 32.0; 80 sequences 9.4 / 18.7 /
# 42.6 against 9.9 / 17.3 / 38.0 (a little slower at short contexts, faster from a few hundred tokens on).
# Llama-3.1-8B's 8 heads of 128 keep the rule: its choice was the best at 48 and 64 sequences; at 16 one split
# beat its four by 1.5 µs at 192 tokens and lost at 640 and more, and at 80 two splits beat its one from 640 tokens
# on (161 against 191 µs at 2048) but lost at 192 -- the best count follows the context, which a captured graph's
# shapes cannot know. Counts outside the listed bounds keep the rule as well.
TUNED_SPLITS: dict[tuple[int, int], tuple[tuple[int, int | None], ...]] = {
    (3, 64): ((47, None), (80, 4)),
}
TUNED_SPLITS_SMS = 132  # H100 SXM and H200


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, device: torch.device,
                      head_dim: int | None = None) -> int:
    """The swept choice for this head shape and sequence count where there is one (`TUNED_SPLITS`), else split
    until the grid holds about two programs per SM, keeping >= 256 tokens per split.

    ``max_tokens`` is the block table's capacity, a shape, so the choice is stable across the
    steps replayed by one CUDA graph.
    """
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    tuned = _tuned_splits(num_seqs, num_kv_heads, head_dim, num_sms)
    if tuned is not None:
        return tuned
    target_programs = 2 * num_sms
    num_splits = 1
    while (
        num_seqs * num_kv_heads * num_splits < target_programs
        and num_splits * 2 * MIN_TOKENS_PER_SPLIT <= max_tokens
        and num_splits < 32
    ):
        num_splits *= 2
    return num_splits


def _tuned_splits(num_seqs: int, num_kv_heads: int, head_dim: int | None, num_sms: int) -> int | None:
    if num_sms != TUNED_SPLITS_SMS:
        return None
    for most_seqs, splits in TUNED_SPLITS.get((num_kv_heads, head_dim or 0), ()):
        if num_seqs <= most_seqs:
            return splits
    return None


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of ``query [B, Hq, D]`` (one token per sequence, at position ``seq_lens - 1``)
    over each sequence's paged K/V. With ``cu_seqlens_q`` ([S + 1], a mixed step's row offsets),
    ``query`` is [T, Hq, D] and only the sequences with exactly one new token are attended (their
    rows of ``out``; the other rows are left as they are). ``block_n``/``num_warps``/``num_stages``
    are tuning knobs."""
    num_q_heads, head_dim = query.shape[1:]
    num_seqs = query.shape[0] if cu_seqlens_q is None else seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1 or query.stride(2) != 1:
        raise ValueError("paged_decode_attention needs matching caches with head_dim contiguous")
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size, query.device,
                                       head_dim)
    queries_per_kv = num_q_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    partial_out = partial_lse = out  # unused when the kernel writes the output directly
    if num_splits > 1:
        partial_out = torch.empty(num_seqs * num_q_heads * num_splits, block_d, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs * num_q_heads * num_splits, dtype=torch.float32, device=query.device)
    rows_from_cu = cu_seqlens_q is not None
    cu = cu_seqlens_q if rows_from_cu else seq_lens  # an unread placeholder without it
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        cu,
        out,
        partial_out,
        partial_lse,
        scale * LOG2_E,
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
        BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        ROWS_FROM_CU=rows_from_cu,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_q_heads)](
            partial_out,
            partial_lse,
            cu,
            out,
            head_dim,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            ROWS_FROM_CU=rows_from_cu,
            num_warps=4,
        )
    return out
