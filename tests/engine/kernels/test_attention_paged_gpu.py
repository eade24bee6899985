"""Paged-attention kernels against their references on a real GPU: block sizes 16/32, MHA and
GQA, lengths 1 to 8k, a mixed prefill + decode batch, bf16/fp16, and CUDA-graph replay."""

import pytest
import torch
from loraplex.engine.kernels.paged_attention_decode import (
    TUNED_SPLITS_SMS,
    choose_num_splits,
    paged_decode_attention,
)
from loraplex.engine.kernels.paged_attention_kv_write import write_kv_cache
from loraplex.engine.kernels.paged_attention_prefill import paged_prefill_attention
from loraplex.engine.kernels.paged_attention_reference import (
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    write_kv_cache_reference,
)
from paged_kv_fixtures import TOLERANCE, make_paged_batch, relative_error

pytestmark = pytest.mark.gpu

HEADS = [(32, 32, 128), (32, 8, 128), (14, 2, 64)]  # MHA, Llama-3 GQA, Qwen2-0.5B-like group of 7
DTYPES = [torch.bfloat16, torch.float16]
BLOCK_SIZES = [16, 32]

# (seq_lens, q_lens): an 8k sequence prefilled as a 2k chunk over a 6k cached prefix, a fresh
# 1.5k prefill, a short chunk over a cached prefix, and decode rows of lengths 1 and 8k.
MIXED_SEQ_LENS = [8192, 1500, 700, 1, 8192, 333]
MIXED_Q_LENS = [2048, 1500, 37, 1, 1, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), HEADS)
def test_gpu_mixed_prefill_and_decode_batch(dtype, block_size, num_q_heads, num_kv_heads, head_dim):
    batch = make_paged_batch(
        MIXED_SEQ_LENS, MIXED_Q_LENS, num_q_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=block_size
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens)
    ours = paged_prefill_attention(*args, head_dim**-0.5, out=torch.full_like(batch.query, float("nan")))
    expected = paged_prefill_attention_reference(*args, head_dim**-0.5)
    assert not ours.isnan().any()
    assert relative_error(ours, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_mixed_batch_with_decodes_apart(dtype, num_q_heads, num_kv_heads, head_dim, num_splits):
    """The mixed batch's decode rows through the decode kernel, its chunks through the prefill kernel."""
    batch = make_paged_batch(MIXED_SEQ_LENS, MIXED_Q_LENS, num_q_heads, num_kv_heads, head_dim, 16, dtype, "cuda")
    cache = (batch.key_cache, batch.value_cache, batch.block_tables)
    out = torch.full_like(batch.query, float("nan"))
    scale = head_dim**-0.5
    paged_decode_attention(batch.query, *cache, batch.seq_lens, scale, num_splits, out=out,
                           cu_seqlens_q=batch.cu_seqlens_q)
    paged_prefill_attention(batch.query, *cache, batch.cu_seqlens_q, batch.seq_lens, scale, out=out,
                            skip_single_rows=True)
    expected = paged_prefill_attention_reference(batch.query, *cache, batch.cu_seqlens_q, batch.seq_lens, scale)
    assert not out.isnan().any()
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_decode_lengths_1_to_8k(dtype, block_size, num_q_heads, num_kv_heads, head_dim, num_splits):
    generator = torch.Generator().manual_seed(block_size + num_q_heads)
    seq_lens = [1, 8192, 2048, *torch.randint(1, 8193, (13,), generator=generator).tolist()]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_q_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, head_dim**-0.5, num_splits)
    ours = paged_decode_attention(*args, out=torch.full_like(batch.query, float("nan")))
    expected = paged_decode_attention_reference(*args)
    assert not ours.isnan().any()
    assert relative_error(ours, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_seqs", [48, 64, 80])
def test_gpu_smollm2_heads_from_48_sequences_take_the_swept_splits(num_seqs):
    """3 KV heads of 64 (SmolLM2-135M): the default split count is the swept one on a 132-SM card, and exact."""
    device = torch.device("cuda", torch.cuda.current_device())
    chosen = choose_num_splits(num_seqs, 3, 8192, device, 64)
    if torch.cuda.get_device_properties(device).multi_processor_count == TUNED_SPLITS_SMS:
        assert chosen == 4
    generator = torch.Generator().manual_seed(num_seqs)
    seq_lens = [1, 8192, 640, *torch.randint(1, 2049, (num_seqs - 3,), generator=generator).tolist()]
    batch = make_paged_batch(seq_lens, [1] * num_seqs, 9, 3, 64, 16, torch.bfloat16, "cuda")
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 0.125)
    ours = paged_decode_attention(*args, chosen, out=torch.full_like(batch.query, float("nan")))
    expected = paged_decode_attention_reference(*args)
    assert not ours.isnan().any()
    assert relative_error(ours, expected) < TOLERANCE[torch.bfloat16]


def test_gpu_write_kv_cache_bf16():
    generator = torch.Generator().manual_seed(0)
    key_cache = torch.randn(64, 16, 8, 128, generator=generator).bfloat16().cuda()
    value_cache = torch.randn(64, 16, 8, 128, generator=generator).bfloat16().cuda()
    key = torch.randn(300, 8, 128, generator=generator).bfloat16().cuda()
    value = torch.randn(300, 8, 128, generator=generator).bfloat16().cuda()
    slots = torch.randperm(64 * 16, generator=generator)[:300].to(torch.int32).cuda()
    slots[::17] = -1
    ours = [key_cache.clone(), value_cache.clone()]
    write_kv_cache(key, value, *ours, slots)
    expected = [key_cache.clone(), value_cache.clone()]
    write_kv_cache_reference(key, value, *expected, slots)
    assert torch.equal(ours[0], expected[0]) and torch.equal(ours[1], expected[1])


def test_gpu_decode_step_replays_in_a_cuda_graph():
    """Capture write + decode once on padded buffers; replay with other lengths and tables."""
    num_seqs, max_blocks, block_size = 8, 64, 16
    first = make_paged_batch([5] * num_seqs, [1] * num_seqs, 32, 8, 128, block_size, torch.bfloat16, "cuda", seed=1)
    key_cache = torch.randn(num_seqs * max_blocks + 4, block_size, 8, 128, device="cuda").bfloat16()
    value_cache = torch.randn_like(key_cache)
    query = first.query.clone()
    new_key = torch.randn(num_seqs, 8, 128, device="cuda").bfloat16()
    new_value = torch.randn_like(new_key)
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(num_seqs, dtype=torch.int32, device="cuda")
    slots = torch.zeros(num_seqs, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)

    def step():
        write_kv_cache(new_key, new_value, key_cache, value_cache, slots)
        paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, 128**-0.5, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    lengths = torch.tensor([1, 1024, 77, 0, 513, 16, 17, 999], dtype=torch.int32)
    tables = torch.randperm(num_seqs * max_blocks, dtype=torch.int32).reshape(num_seqs, max_blocks)
    last = (lengths - 1).clamp_min(0)
    new_slots = (tables.gather(1, (last // block_size)[:, None].long())[:, 0] * block_size + last % block_size).int()
    new_slots[lengths == 0] = -1
    query.copy_(torch.randn_like(query))
    new_key.copy_(torch.randn_like(new_key))
    new_value.copy_(torch.randn_like(new_value))
    block_tables.copy_(tables)
    seq_lens.copy_(lengths)
    slots.copy_(new_slots)
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()
    write_kv_cache_reference(new_key, new_value, expected_key_cache, expected_value_cache, slots)
    graph.replay()
    expected = paged_decode_attention_reference(
        query, expected_key_cache, expected_value_cache, block_tables, seq_lens, 128**-0.5
    )
    assert torch.equal(key_cache, expected_key_cache)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]
