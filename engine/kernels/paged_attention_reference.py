"""PyTorch references for the paged-attention kernels, with the kernels' exact signatures.

Paged KV layout, per layer: ``key_cache`` and ``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides with ``head_dim`` contiguous
work for the Triton kernels). The CPU engine's flat per-layer cache
``[num_blocks * block_size, num_kv_heads, head_dim]`` is the same memory: pass
``cache.view(-1, block_size, num_kv_heads, head_dim)``. Token ``i`` of a sequence lives in block
``block_tables[seq, i // block_size]`` at offset ``i % block_size``; a slot number is
``block_id * block_size + offset``.

Batch metadata (all int32 tensors on the device, so kernels need no host sync):
- ``cu_seqlens_q [num_seqs + 1]``: query rows of sequence ``s`` are ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``;
- ``seq_lens [num_seqs]``: KV length of each sequence *including* its new tokens, so its
  queries sit at positions ``seq_lens[s] - q_len + i`` and attend causally to ``[0, position]``;
- ``block_tables [num_seqs, max_blocks_per_seq]``.
The new tokens' K/V must already be in the cache (``write_kv_cache``) before attention runs.

These references are slow (a Python loop over sequences, float32 math, host syncs); they are
the oracle for the kernels and the readable statement of what they compute.
"""

import torch


def write_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key[t]``/``value[t]`` ([T, num_kv_heads, head_dim]) at slot ``slot_mapping[t]``; -1 skips."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


def gather_sequence_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence as ``[seq_len, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first_position: int, scale: float) -> torch.Tensor:
    """Causal attention of queries at ``first_position + i`` over keys at ``0..len-1``, in float32."""
    num_q_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_q_heads // num_kv_heads
    q = query.float().transpose(0, 1)
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) * scale
    q_positions = first_position + torch.arange(query.shape[0], device=query.device)
    k_positions = torch.arange(key.shape[0], device=query.device)
    scores = scores.masked_fill(k_positions[None, :] > q_positions[:, None], float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(0, 1)


def paged_prefill_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention for new tokens ``query [T, Hq, D]`` over each sequence's cache."""
    out = torch.empty_like(query) if out is None else out
    starts = cu_seqlens_q.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        key = gather_sequence_kv(key_cache, block_tables[seq], seq_len)
        value = gather_sequence_kv(value_cache, block_tables[seq], seq_len)
        out[start:end] = attend(query[start:end], key, value, seq_len - (end - start), scale).to(out.dtype)
    return out


def paged_decode_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (``query [B, Hq, D]``) over its whole cache; ``seq_lens`` 0 gives zeros.

    ``num_splits`` only tunes the kernel; the reference ignores it.
    """
    del num_splits
    out = torch.empty_like(query) if out is None else out
    for seq, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[seq] = 0
            continue
        key = gather_sequence_kv(key_cache, block_tables[seq], seq_len)
        value = gather_sequence_kv(value_cache, block_tables[seq], seq_len)
        out[seq] = attend(query[seq : seq + 1], key, value, seq_len - 1, scale)[0].to(out.dtype)
    return out
