"""Random paged KV caches and batch metadata shared by the attention-kernel tests and benchmark."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedBatch:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    query: torch.Tensor


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """A cache of random K/V whose sequences own shuffled, non-contiguous blocks.

    ``seq_lens[s]`` counts the sequence's tokens including its ``q_lens[s]`` new ones; the
    block table is one column wider than needed and padded with a valid block id (0), as a
    runner pads it.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator)
    width = max([*blocks_per_seq, 1]) + 1
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = order[used : used + count]
        used += count
    # Draw the (large) random tensors where they live: CPU generation of an 8k-token cache is slow.
    on_device = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        key_cache=torch.randn(shape, generator=on_device, device=device).to(dtype),
        value_cache=torch.randn(shape, generator=on_device, device=device).to(dtype),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu_seqlens_q.to(device),
        query=torch.randn(sum(q_lens), num_q_heads, head_dim, generator=on_device, device=device).to(dtype),
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
