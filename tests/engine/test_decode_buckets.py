"""CPU decode attention in length buckets: the split is optimal and the output equals unpadded attention."""

from __future__ import annotations

import itertools
import random

import torch
import torch.nn.functional as F
from enginecore_helpers import padded_blocks
from loraplex.engine.attention import paged_attention
from loraplex.engine.context import AttentionMetadata, DecodeBucket
from loraplex.engine.runner import _additive, decode_buckets


def _cost(num_blocks: list[int], buckets: list[tuple[int, int]], overhead: int) -> int:
    return sum((end - start) * num_blocks[end - 1] + overhead for start, end in buckets)


def test_buckets_are_contiguous_and_as_cheap_as_any_split():
    rng = random.Random(0)
    for _ in range(200):
        num_blocks = sorted(rng.randint(1, 30) for _ in range(rng.randint(1, 9)))
        buckets = decode_buckets(num_blocks, max_buckets=4, overhead=2)
        assert 4 >= len(buckets) >= 1
        assert buckets[0][0] == 0 and buckets[-1][1] == len(num_blocks)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(buckets))
        best = min(  # brute force over every way to cut the rows into <= 4 ranges
            _cost(num_blocks, list(itertools.pairwise((0, *cuts, len(num_blocks)))), 2)
            for k in range(4)
            for cuts in itertools.combinations(range(1, len(num_blocks)), k)
        )
        assert _cost(num_blocks, buckets, 2) == best


def test_mixed_lengths_get_several_buckets_equal_lengths_one():
    assert len(decode_buckets([2] * 8 + [30] * 8)) == 2
    assert decode_buckets([5, 5, 5]) == [(0, 3)]


def test_bucketed_decode_attention_equals_each_row_alone():
    """Rows of very different lengths, padded per bucket, match attention over each row's own tokens."""
    torch.manual_seed(0)
    bs, kv_heads, heads, dim = 4, 2, 4, 8
    lengths = sorted([1, 3, 4, 9, 17, 18, 40, 41, 64])
    num_blocks_total = 64
    k_cache = torch.randn(num_blocks_total * bs, kv_heads, dim)
    v_cache = torch.randn(num_blocks_total * bs, kv_heads, dim)
    perm = torch.randperm(num_blocks_total - 1) + 1  # block 0 is the padding block
    tables, used = [], 0
    for n in lengths:
        need = (n + bs - 1) // bs
        tables.append(perm[used : used + need].tolist())
        used += need
    num_blocks = [len(t) for t in tables]
    table = torch.tensor([padded_blocks(t, num_blocks[-1]) for t in tables])
    lens = torch.tensor(lengths)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(lengths),
                             block_size=bs)
    buckets = decode_buckets(num_blocks, overhead=0)
    assert len(buckets) > 1
    for start, end in buckets:
        span = num_blocks[end - 1] * bs
        mask = _additive((torch.arange(span) < lens[start:end].unsqueeze(1)).view(end - start, 1, 1, span),
                         k_cache.dtype)
        meta.decode_buckets.append(DecodeBucket(start, end, table[start:end, : num_blocks[end - 1]].reshape(-1),
                                                mask))
    q = torch.randn(len(lengths), heads, dim)
    # The step's own K/V are already in the cache here: write them back unchanged.
    last = torch.tensor([tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lengths)])
    meta.slot_mapping = last
    out = paged_attention(q, k_cache[last].clone(), v_cache[last].clone(), k_cache, v_cache, meta, 0.3)
    for i, n in enumerate(lengths):
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        ref = F.scaled_dot_product_attention(q[i : i + 1].unsqueeze(2), k_cache[slots].transpose(0, 1)[None],
                                             v_cache[slots].transpose(0, 1)[None], scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[i], ref.reshape(-1), rtol=1e-5, atol=1e-5)
