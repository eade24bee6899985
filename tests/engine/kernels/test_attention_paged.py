"""Paged-attention Triton kernels against their PyTorch references (interpreter on the CPU).

Small shapes with small tiles, so that multi-tile, multi-block and multi-split paths all run
through Triton's interpreter in seconds; the GPU sweep is in test_attention_paged_gpu.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from loraplex.engine.kernels.paged_attention_decode import _tuned_splits, paged_decode_attention
from loraplex.engine.kernels.paged_attention_kv_write import write_kv_cache
from loraplex.engine.kernels.paged_attention_prefill import paged_prefill_attention
from loraplex.engine.kernels.paged_attention_reference import (
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    write_kv_cache_reference,
)
from paged_kv_fixtures import TOLERANCE, make_paged_batch, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TILES = {"block_m": 16, "block_n": 16, "num_warps": 4}


def test_reference_matches_dense_causal_sdpa_when_prefill_is_chunked():
    """The reference itself: two chunks over a cached prefix equal one dense causal pass."""
    batch = make_paged_batch([37], [37], 4, 2, 16, 8, torch.float32, "cpu", seed=1)
    scale = 1 / math.sqrt(16)
    dense = F.scaled_dot_product_attention(
        batch.query.transpose(0, 1)[None],
        batch.key_cache[batch.block_tables[0, :5].long()].reshape(40, 2, 16)[:37].transpose(0, 1)[None],
        batch.value_cache[batch.block_tables[0, :5].long()].reshape(40, 2, 16)[:37].transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)
    first = paged_prefill_attention_reference(
        batch.query[:20], batch.key_cache, batch.value_cache, batch.block_tables,
        torch.tensor([0, 20], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), scale,
    )  # fmt: skip
    second = paged_prefill_attention_reference(
        batch.query[20:], batch.key_cache, batch.value_cache, batch.block_tables,
        torch.tensor([0, 17], dtype=torch.int32), torch.tensor([37], dtype=torch.int32), scale,
    )  # fmt: skip
    assert relative_error(torch.cat([first, second]), dense) < 1e-6


@pytest.mark.parametrize("block_size", [4, 16])
def test_write_kv_cache_matches_reference_and_skips_padding(block_size):
    generator = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim = 6, 3, 24
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=generator)
    value_cache = torch.randn(cache_shape, generator=generator)
    # K and V as strided views of one fused projection output, as the model produces them.
    fused = torch.randn(9, 2, num_kv_heads, head_dim, generator=generator)
    key, value = fused[:, 0], fused[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:9].to(torch.int32)
    slots[[2, 7]] = -1
    ours = [key_cache.clone().to(DEVICE), value_cache.clone().to(DEVICE)]
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), *ours, slots.to(DEVICE))
    expected = [key_cache.clone(), value_cache.clone()]
    write_kv_cache_reference(key, value, *expected, slots)
    assert torch.equal(ours[0].cpu(), expected[0]) and torch.equal(ours[1].cpu(), expected[1])
    assert not torch.equal(expected[0], key_cache)


PREFILL_CASES = [
    # (seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size)
    ([19], [19], 2, 2, 16, 4),  # plain prefill, MHA, several q tiles
    ([40, 9], [15, 9], 4, 2, 32, 8),  # cached prefix + fresh prefill, GQA
    ([33, 5, 70, 12], [1, 5, 3, 1], 8, 2, 16, 16),  # mixed decode and chunked prefill
    ([23, 17], [6, 17], 6, 2, 40, 4),  # group of 3, head_dim not a power of two
    ([50], [34], 4, 1, 16, 8),  # multi-query
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("seq_lens", "q_lens", "num_q_heads", "num_kv_heads", "head_dim", "block_size"), PREFILL_CASES)
def test_prefill_matches_reference(dtype, seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size):
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE)
    scale = head_dim**-0.5
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, scale)
    poisoned = torch.full_like(batch.query, float("nan"))
    ours = paged_prefill_attention(*args, out=poisoned, **SMALL_TILES)
    expected = paged_prefill_attention_reference(*args)
    assert not ours.isnan().any()
    assert relative_error(ours, expected) < TOLERANCE[dtype]


DECODE_CASES = [
    # (seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, num_splits)
    ([1, 7, 64, 29], 4, 4, 16, 4, 1),
    ([1, 7, 64, 29], 4, 4, 16, 4, 3),  # splits of unequal use, some empty for short sequences
    ([45, 100], 8, 2, 32, 16, 4),
    ([0, 18, 5], 6, 2, 40, 8, 2),  # a padded row of length 0 comes back as zeros
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("seq_lens", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "num_splits"), DECODE_CASES)
def test_decode_matches_reference(dtype, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, num_splits):
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_q_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE)
    scale = head_dim**-0.5
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, scale, num_splits)
    poisoned = torch.full_like(batch.query, float("nan"))
    ours = paged_decode_attention(*args, out=poisoned, block_n=16)
    expected = paged_decode_attention_reference(*args)
    assert not ours.isnan().any()
    assert relative_error(ours, expected) < TOLERANCE[dtype]
    for row, length in enumerate(seq_lens):
        if length == 0:
            assert torch.equal(ours[row].cpu(), torch.zeros_like(ours[row].cpu()))


def test_swept_split_counts_apply_only_to_their_head_shape_sequence_counts_and_card():
    """SmolLM2's 3 KV heads of 64 take 4 splits from 48 to 80 sequences on a 132-SM card; fewer sequences, other
    head shapes (or no head_dim given) and other cards keep the programs-per-SM rule (None)."""
    assert [_tuned_splits(n, 3, 64, 132) for n in (1, 16, 47, 48, 64, 66, 80)] == [None, None, None, 4, 4, 4, 4]
    assert _tuned_splits(81, 3, 64, 132) is None
    assert _tuned_splits(64, 8, 128, 132) is None
    assert _tuned_splits(64, 3, None, 132) is None
    assert _tuned_splits(64, 3, 64, 108) is None


def test_decode_and_prefill_kernels_agree_on_single_token_queries():
    batch = make_paged_batch([13, 40, 2], [1, 1, 1], 4, 2, 16, 8, torch.float32, DEVICE, seed=5)
    scale = 0.25
    decode = paged_decode_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, scale, 2, block_n=16
    )
    prefill = paged_prefill_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
        scale, **SMALL_TILES,
    )  # fmt: skip
    assert relative_error(decode, prefill) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_step_with_decodes_apart_matches_reference(num_splits):
    """A mixed step's decodes through the decode kernel (rows found from cu_seqlens_q) and its prompt chunks
    through the prefill kernel skipping one-row sequences: together every row equals the reference, padded
    sequences (no rows) write nothing, and neither kernel touches the other's rows."""
    seq_lens, q_lens = [40, 9, 1, 23, 30, 0], [1, 9, 1, 5, 1, 0]  # decode, fresh prompt, decode, chunk, decode, pad
    batch = make_paged_batch(seq_lens, q_lens, 4, 2, 16, 8, torch.float32, DEVICE, seed=9)
    num_rows = batch.query.shape[0]
    # a graph's query is padded past the last sequence's rows: the pad sequence's offset points there
    query = torch.cat([batch.query, torch.randn(2, *batch.query.shape[1:], device=batch.query.device)])
    cu = batch.cu_seqlens_q
    scale = 0.25
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, scale,
                           num_splits, out=out, cu_seqlens_q=cu, block_n=16)
    single = [int(cu[s]) for s in range(len(seq_lens)) if q_lens[s] == 1]
    assert not out[single].isnan().any()
    assert out[[r for r in range(num_rows + 2) if r not in single]].isnan().all()  # the rest left alone
    paged_prefill_attention(query, batch.key_cache, batch.value_cache, batch.block_tables, cu, batch.seq_lens, scale,
                            out=out, skip_single_rows=True, **SMALL_TILES)
    expected = paged_prefill_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                                 cu, batch.seq_lens, scale)
    assert not out[:num_rows].isnan().any()
    assert out[num_rows:].isnan().all()  # padding rows untouched by both
    assert relative_error(out[:num_rows], expected) < TOLERANCE[torch.float32]


def test_chunked_prefill_then_decode_through_the_cache():
    """Write each chunk's K/V, attend, then decode: equals dense causal attention over it all."""
    generator = torch.Generator().manual_seed(9)
    num_q_heads, num_kv_heads, head_dim, block_size, total = 4, 2, 16, 4, 23
    query = torch.randn(total, num_q_heads, head_dim, generator=generator)
    key = torch.randn(total, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(total, num_kv_heads, head_dim, generator=generator)
    key_cache = torch.full((8, block_size, num_kv_heads, head_dim), float("nan"), device=DEVICE)
    value_cache = torch.full_like(key_cache, float("nan"))
    block_table = torch.tensor([[5, 2, 7, 0, 3, 6]], dtype=torch.int32)
    slot_of = [int(block_table[0, t // block_size]) * block_size + t % block_size for t in range(total)]
    outputs = []
    for start, end in [(0, 10), (10, 22)]:
        slots = torch.tensor(slot_of[start:end], dtype=torch.int32, device=DEVICE)
        write_kv_cache(key[start:end].to(DEVICE), value[start:end].to(DEVICE), key_cache, value_cache, slots)
        outputs.append(
            paged_prefill_attention(
                query[start:end].to(DEVICE), key_cache, value_cache, block_table.to(DEVICE),
                torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE),
                torch.tensor([end], dtype=torch.int32, device=DEVICE), 0.25, **SMALL_TILES,
            )
        )
    write_kv_cache(
        key[22:].to(DEVICE), value[22:].to(DEVICE), key_cache, value_cache,
        torch.tensor(slot_of[22:], dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    outputs.append(
        paged_decode_attention(
            query[22:].to(DEVICE), key_cache, value_cache, block_table.to(DEVICE),
            torch.tensor([total], dtype=torch.int32, device=DEVICE), 0.25, 2, block_n=16,
        )
    )
    dense = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
        is_causal=True, scale=0.25, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    assert relative_error(torch.cat(outputs).cpu(), dense) < 1e-5


def test_int64_metadata_and_flat_engine_cache_view():
    """The CPU engine keeps a flat [slots, kv_heads, D] cache and int64 slots: a view works."""
    batch = make_paged_batch([30, 9], [4, 1], 4, 2, 16, 8, torch.float32, DEVICE, seed=3)
    flat_keys = batch.key_cache.reshape(-1, 2, 16)
    flat_values = batch.value_cache.reshape(-1, 2, 16)
    metadata = [batch.block_tables.long(), batch.cu_seqlens_q.long(), batch.seq_lens.long()]
    ours = paged_prefill_attention(
        batch.query, flat_keys.view(-1, 8, 2, 16), flat_values.view(-1, 8, 2, 16), *metadata, 0.25, **SMALL_TILES
    )
    expected = paged_prefill_attention_reference(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, 0.25
    )
    assert relative_error(ours, expected) < 1e-5
