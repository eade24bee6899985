"""The "triton" attention backend: fused rotary, K/V cache write, paged attention kernels.

The runner builds `TritonAttentionMetadata` once per step (integer tensors already on the
device). A step whose every sequence has one new token takes the FlashDecoding kernel with a
split count fixed by shapes (so a CUDA graph can replay it); any other step, prefill chunks
and decodes mixed, takes the variable-length prefill kernel, and where it has decodes too
(`decodes_apart`) those take the FlashDecoding kernel beside it: the prefill kernel gives each
sequence a whole tile of queries (one valid row in 32 for a decode), and a step of 62 decodes beside
two short prompt chunks (Llama-3.1-8B shapes, rank-8 adapters, an H200) spent 2.07 ms of its 7.17 ms of
GPU time in attention that way, 1.39 of 6.49 ms with the decodes apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loraplex.engine.context import StepContext
from loraplex.engine.cuda.fused_ops import rotary_, rotary_write_kv_
from loraplex.engine.kernels.paged_attention_decode import paged_decode_attention
from loraplex.engine.kernels.paged_attention_kv_write import write_kv_cache
from loraplex.engine.kernels.paged_attention_prefill import paged_prefill_attention


@dataclass(slots=True)
class TritonAttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor            # [T] int32 flat cache slot of each new token; -1 = padding row
    block_tables: torch.Tensor            # [S, W] int32
    seq_lens: torch.Tensor                # [S] int32 tokens of context after this step (0 = padding)
    cu_seqlens_q: torch.Tensor | None     # [S + 1] int32 row offsets; None: one row per sequence (decode)
    num_splits: int = 1                   # the decode kernel's KV-length splits, chosen from shapes
    decodes_apart: bool = False           # with cu_seqlens_q: one-row sequences take the decode kernel


class TritonPagedAttention:
    fuse_rotary_kv_write = True  # one kernel for rotary and the cache write (False: two, for comparison)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor:
        meta = ctx.attention_as(TritonAttentionMetadata)
        # The pool is flat [slots, kv_heads, D] (shared with the CPU path's block copies and
        # host swaps); the kernels read it as [blocks, block_size, kv_heads, D].
        key_cache = kv_cache[0].view(-1, meta.block_size, *kv_cache[0].shape[1:])
        value_cache = kv_cache[1].view(-1, meta.block_size, *kv_cache[1].shape[1:])
        if self.fuse_rotary_kv_write:
            rotary_write_kv_(q, k, v, ctx.cos, ctx.sin, key_cache, value_cache, meta.slot_mapping)
        else:
            rotary_(q, k, ctx.cos, ctx.sin)
            write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        if meta.cu_seqlens_q is None:
            paged_decode_attention(q, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                                   num_splits=meta.num_splits, out=out)
        else:
            if meta.decodes_apart:
                paged_decode_attention(q, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                                       num_splits=meta.num_splits, out=out, cu_seqlens_q=meta.cu_seqlens_q)
            paged_prefill_attention(q, key_cache, value_cache, meta.block_tables, meta.cu_seqlens_q,
                                    meta.seq_lens, scale, out=out, skip_single_rows=meta.decodes_apart)
        return out.view(q.shape[0], -1)
