"""Paged attention in plain PyTorch (the CPU path).

Each layer's cache is a pair of tensors `[num_blocks * block_size, kv_heads,
head_dim]`; a token's slot is `block_id * block_size + offset`. K/V are
gathered whole blocks at a time (one contiguous copy per block, much cheaper
than per-slot indexing). Decodes, sorted by context length, run as one masked
SDPA per length bucket (a few; see `runner.decode_buckets`), so a short context
is not padded to the step's longest; prefill chunks run one SDPA each (causal,
or masked over a cached prefix).

When the C++ decode kernel (`engine/kernels/cpu_paged_decode.cpp`) is built, the runner sends
`CpuAttentionMetadata` with a `DecodeTable` instead of buckets: each decode row's K/V blocks are
then read in place in one pass (no gathered copy, no padding, no mask). The buckets stay as the
fallback (no compiler, unsupported dtype) and as the reference the kernel is tested against.

Backends plug in through `ATTENTION_BACKENDS` (name -> factory): "torch" here,
"triton" (the CUDA kernels, `engine/cuda/attention.py`). Each runner picks the
backend whose metadata it builds and hands it to the model in the step context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from loraplex.engine.context import AttentionBackend, AttentionMetadata, StepContext
from loraplex.engine.kernels.cpu_paged_decode import paged_decode_kernel
from loraplex.engine.model.layers import apply_rotary


@dataclass(slots=True)
class DecodeTable:
    """What the decode kernel needs: per decode row its blocks (padded with 0) and context length."""

    block_table: torch.Tensor                 # [rows, max_blocks] int32
    lengths: torch.Tensor                     # [rows] int32, tokens of context incl. this step's


@dataclass(slots=True)
class CpuAttentionMetadata(AttentionMetadata):
    decode_table: DecodeTable | None = None   # set: decodes run in the kernel, `decode_buckets` is empty


class TorchPagedAttention:
    """The CPU backend: PyTorch rotary, `index_copy_` into the cache, SDPA (the reference path)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor:
        q = apply_rotary(q, ctx.cos, ctx.sin)
        k = apply_rotary(k, ctx.cos, ctx.sin)
        return paged_attention(q, k, v, kv_cache[0], kv_cache[1], ctx.attention_as(AttentionMetadata), scale)


def _triton_backend() -> AttentionBackend:
    from loraplex.engine.cuda.attention import TritonPagedAttention

    return TritonPagedAttention()


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchPagedAttention,
    "triton": _triton_backend,
}


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D] for the step's new tokens. Returns [T, heads * D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads, head_dim)
    gqa = num_heads != k.shape[1]
    table = getattr(meta, "decode_table", None)
    if table is not None:  # the runner only sets it once the kernel has loaded
        rows = meta.num_decode_tokens
        out[:rows] = paged_decode_kernel().paged_decode(
            q[:rows], k_cache, v_cache, table.block_table, table.lengths, meta.block_size, scale)
    for bucket in meta.decode_buckets:  # rows sorted by length: each bucket pads only to its own longest
        rows = bucket.end - bucket.start
        kd = gather_blocks(k_cache, bucket.blocks, rows, meta.block_size).transpose(1, 2)  # [b, kv, S, D]
        vd = gather_blocks(v_cache, bucket.blocks, rows, meta.block_size).transpose(1, 2)
        qd = q[bucket.start : bucket.end].unsqueeze(2)   # [b, heads, 1, D]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=bucket.mask, scale=scale, enable_gqa=gqa)
        out[bucket.start : bucket.end] = od.squeeze(2)
    for span in meta.prefills:
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, heads, L, D]
        if span.context_blocks is None:
            ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
            vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            ks = gather_blocks(k_cache, span.context_blocks, 1, meta.block_size).transpose(1, 2)
            vs = gather_blocks(v_cache, span.context_blocks, 1, meta.block_size).transpose(1, 2)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scale, enable_gqa=gqa)
        out[span.start : span.end] = os_.squeeze(0).transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, batch: int, block_size: int) -> torch.Tensor:
    """[slots, kv_heads, D] cache, [batch * blocks] ids -> [batch, blocks * block_size, kv_heads, D]."""
    _, kv_heads, head_dim = cache.shape
    rows = cache.view(-1, block_size * kv_heads * head_dim).index_select(0, block_ids)
    return rows.view(batch, -1, kv_heads, head_dim)
