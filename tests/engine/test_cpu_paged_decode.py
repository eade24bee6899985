"""The C++ CPU paged decode kernel against the gather + SDPA path, and the engine with and without it."""

from __future__ import annotations

import logging

import pytest
import torch
from enginecore_helpers import greedy, output_tokens, padded_blocks, run_to_completion
from loraplex.engine.attention import CpuAttentionMetadata, DecodeTable, paged_attention
from loraplex.engine.context import AttentionMetadata, DecodeBucket
from loraplex.engine.kernels import cpu_paged_decode
from loraplex.engine.protocol import EngineRequest
from loraplex.engine.runner import _additive, decode_buckets


@pytest.fixture(scope="module")
def kernel():
    module = cpu_paged_decode.paged_decode_kernel()
    assert module is not None, "the CPU paged decode kernel did not build (see the logged warning)"
    return module


def random_case(seed: int, bs: int, heads: int, kv_heads: int, dim: int, lengths: list[int], dtype=torch.float32):
    """Caches with random, non-contiguous block tables; rows 0 and 1 share their leading blocks."""
    generator = torch.Generator().manual_seed(seed)
    total_blocks = sum((n + bs - 1) // bs for n in lengths) + 8
    k_cache = torch.randn(total_blocks * bs, kv_heads, dim, generator=generator).to(dtype)
    v_cache = torch.randn(total_blocks * bs, kv_heads, dim, generator=generator).to(dtype)
    perm = (torch.randperm(total_blocks - 1, generator=generator) + 1).tolist()  # block 0: padding only
    tables, used = [], 0
    for n in lengths:
        need = (n + bs - 1) // bs
        tables.append(perm[used : used + need])
        used += need
    shared = min(len(tables[0]), len(tables[1])) - 1  # a shared prefix (as the prefix cache makes)
    tables[1][:shared] = tables[0][:shared]
    q = torch.randn(len(lengths), heads, dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables


def reference(q, k_cache, v_cache, tables, lengths, bs, scale):
    """The engine's bucketed gather + SDPA path (rows sorted by length, as the runner sorts them)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    lens = torch.tensor([lengths[i] for i in order])
    num_blocks = [len(tables[i]) for i in order]
    table = torch.tensor([padded_blocks(tables[i], num_blocks[-1]) for i in order])
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(lengths),
                             block_size=bs)
    for start, end in decode_buckets(num_blocks):
        span = num_blocks[end - 1] * bs
        allowed = (torch.arange(span) < lens[start:end].unsqueeze(1)).view(end - start, 1, 1, span)
        meta.decode_buckets.append(DecodeBucket(start, end, table[start:end, : num_blocks[end - 1]].reshape(-1),
                                                _additive(allowed, k_cache.dtype)))
    # The step's own K/V are already in the cache: write them back unchanged.
    last = torch.tensor([tables[i][(lengths[i] - 1) // bs] * bs + (lengths[i] - 1) % bs for i in order])
    meta.slot_mapping = last
    out = paged_attention(q[order], k_cache[last].clone(), v_cache[last].clone(), k_cache, v_cache, meta, scale)
    result = torch.empty_like(q)
    result[order] = out.view(q.shape)
    return result


def kernel_inputs(tables, lengths, index_dtype):
    width = max(len(t) for t in tables)
    table = torch.tensor([padded_blocks(t, width) for t in tables], dtype=index_dtype)
    return table, torch.tensor(lengths, dtype=index_dtype)


@pytest.mark.parametrize("bs", [1, 4, 16, 48])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
def test_kernel_matches_gather_and_sdpa(kernel, bs, heads, kv_heads, dim):
    # Lengths 1 .. several blocks, whole and partial last blocks, more than one 32-token chunk.
    lengths = [1, 2, bs, bs + 1, 3 * bs - 1, 5 * bs, 7 * bs + 3, 33, 70, 1]
    q, k_cache, v_cache, tables = random_case(bs * 31 + heads, bs, heads, kv_heads, dim, lengths)
    scale = dim ** -0.5
    expected = reference(q, k_cache, v_cache, tables, lengths, bs, scale)
    for index_dtype in (torch.int32, torch.int64):
        table, lens = kernel_inputs(tables, lengths, index_dtype)
        got = kernel.paged_decode(q, k_cache, v_cache, table, lens, bs, scale)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_with_several_threads_matches_one(kernel):
    lengths = [5, 300, 17, 64, 129, 1, 90, 250]
    q, k_cache, v_cache, tables = random_case(7, 16, 9, 3, 64, lengths)
    table, lens = kernel_inputs(tables, lengths, torch.int32)
    one = kernel.paged_decode(q, k_cache, v_cache, table, lens, 16, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = kernel.paged_decode(q, k_cache, v_cache, table, lens, 16, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (row, kv head) is computed whole by one thread


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_precision_inputs_accumulate_in_float32(kernel, dtype):
    lengths = [3, 40, 100, 17]
    q, k_cache, v_cache, tables = random_case(11, 16, 9, 3, 64, lengths, dtype=dtype)
    table, lens = kernel_inputs(tables, lengths, torch.int64)
    got = kernel.paged_decode(q, k_cache, v_cache, table, lens, 16, 0.125)
    assert got.dtype == dtype
    expected = reference(q.float(), k_cache.float(), v_cache.float(), tables, lengths, 16, 0.125)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


def test_paged_attention_uses_the_decode_table_and_still_runs_prefills(kernel):
    """A step with decodes (through the kernel) and a prefill chunk equals the all-PyTorch step."""
    bs, lengths = 16, [20, 3, 45]
    q, k_cache, v_cache, tables = random_case(3, bs, 9, 3, 64, lengths)
    expected = reference(q, k_cache, v_cache, tables, lengths, bs, 0.125)
    table, lens = kernel_inputs(tables, lengths, torch.int32)
    last = torch.tensor([tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lengths)])
    meta = CpuAttentionMetadata(slot_mapping=last, num_decode_tokens=len(lengths), block_size=bs,
                                decode_table=DecodeTable(table, lens))
    out = paged_attention(q, k_cache[last].clone(), v_cache[last].clone(), k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out.view(q.shape), expected, rtol=1e-5, atol=1e-5)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, caplog):
    def broken() -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_paged_decode, "_load", broken)
    with caplog.at_level(logging.WARNING, logger=cpu_paged_decode.__name__):
        assert cpu_paged_decode._build() is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "no compiler here" in caplog.records[0].getMessage()


def test_engine_greedy_tokens_equal_with_and_without_the_kernel(kernel, smol, chat_prompt_ids):
    def generate(use_kernel: bool) -> dict[str, list[int]]:
        engine = smol.engine()
        assert engine.runner.use_decode_kernel  # float32 on the CPU: the kernel is picked when built
        engine.runner.use_decode_kernel = use_kernel
        requests = [EngineRequest(f"r{i}", ids, greedy(24 + 8 * i)) for i, ids in enumerate(chat_prompt_ids[:5])]
        outputs = run_to_completion(engine, requests)
        return {rid: output_tokens(out) for rid, out in outputs.items()}

    with_kernel, without = generate(True), generate(False)
    assert all(len(tokens) > 0 for tokens in with_kernel.values())
    assert with_kernel == without
