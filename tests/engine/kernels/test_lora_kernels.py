"""Triton LoRA kernels against the PyTorch reference (interpreter on the CPU, compiled on a GPU).

The reference reads only the per-token slots, the kernels only the slot-sorted tiles, so
every comparison also checks the metadata builder.
"""

from __future__ import annotations

import pytest
import torch
from loraplex.engine.kernels.lora_metadata import build_lora_metadata, build_lora_metadata_for_segments
from loraplex.engine.kernels.lora_reference import add_lora_ref, lora_expand_ref, lora_shrink_ref
from loraplex.engine.kernels.lora_triton import LoRAKernelConfig, add_lora, lora_expand, lora_shrink
from loraplex.engine.kernels.lora_weights import LoRAStack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_stack(
    *,
    num_slots: int,
    max_rank: int,
    in_features: int,
    out_sizes: tuple[int, ...],
    ranks: list[list[int]],
    dtype: torch.dtype,
    generator: torch.Generator,
) -> LoRAStack:
    """Slots with random A and non-zero B; ranks[slot][slice] (0 = slice not adapted)."""
    stack = LoRAStack.allocate(
        num_slots=num_slots, max_rank=max_rank, in_features=in_features, out_sizes=out_sizes,
        dtype=dtype, device=DEVICE,
    )
    for slot, slot_ranks in enumerate(ranks):
        for i, rank in enumerate(slot_ranks):
            if rank:
                a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                b = torch.randn(out_sizes[i], rank, generator=generator) / rank**0.5
                scaling = float(torch.rand((), generator=generator)) + 0.5
                stack.set_slot(slot, i, a.to(dtype), b.to(dtype), scaling)
    # Poison the padding past each rank: the kernels must never read it.
    for slot, slot_ranks in enumerate(ranks):
        for i, rank in enumerate(slot_ranks):
            start = stack.out_offset(i)
            stack.lora_a[slot, i, rank:] = float("nan")
            stack.lora_b[slot, start : start + out_sizes[i], rank:] = float("nan")
    return stack


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def run_case(
    *,
    in_features: int,
    out_sizes: tuple[int, ...],
    max_rank: int,
    ranks: list[list[int]],
    token_slots: list[int],
    dtype: torch.dtype = torch.float32,
    config: LoRAKernelConfig | None = None,
    block_m: int | None = None,
    tol: float = 1e-5,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    stack = random_stack(
        num_slots=len(ranks), max_rank=max_rank, in_features=in_features, out_sizes=out_sizes,
        ranks=ranks, dtype=dtype, generator=gen,
    )
    meta = build_lora_metadata(token_slots, max_loras=len(ranks), device=DEVICE, block_m=block_m)
    num_tokens = len(token_slots)
    x = torch.randn(num_tokens, in_features, generator=gen).to(DEVICE, dtype)
    y = torch.randn(num_tokens, sum(out_sizes), generator=gen).to(DEVICE, dtype)

    expected = y.clone()
    add_lora_ref(expected, x, stack, meta)
    got = y.clone()
    add_lora(got, x, stack, meta, config=config)
    delta_expected = expected.double() - y.double()
    assert rel_error(got.double() - y.double(), delta_expected) < tol
    no_adapter = torch.tensor(token_slots, device=DEVICE) < 0
    assert torch.equal(got[no_adapter], y[no_adapter])
    assert not meta.sync.any(), "kernels must leave the tile counters zeroed"


CASES = {
    # name: (in, out_sizes, max_rank, ranks per slot, token slots)
    "h64_r1_one_token": (64, (64,), 1, [[1]], [0]),
    "h64_r16_decode_mixed": (64, (64,), 16, [[16], [1], [7]], [2, 0, -1, 1, 0, 2, -1, 2]),
    "h200_odd_sizes": (200, (136,), 8, [[8], [3]], [1, 1, 0, -1, 0, 1, 1]),
    "qkv_slices_mixed_ranks": (96, (64, 32, 32), 16, [[16, 8, 16], [4, 0, 4], [1, 1, 1]], [0, 1, 2, 2, 1, -1, 0]),
    "gate_up_slices": (64, (96, 96), 32, [[32, 32], [5, 17]], [1, 0, 1, 1, 0]),
    "rank64_max": (128, (64,), 64, [[64], [33], [2]], [2, 1, 0, 0, 1, 2]),
    "all_tokens_base_model": (64, (64,), 8, [[8], [8]], [-1, -1, -1]),
    "sixteen_adapters_one_token_each": (64, (32,), 16, [[1 + (s * 3) % 16] for s in range(16)], list(range(16))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_add_lora_matches_reference(name: str) -> None:
    in_features, out_sizes, max_rank, ranks, token_slots = CASES[name]
    run_case(in_features=in_features, out_sizes=out_sizes, max_rank=max_rank, ranks=ranks, token_slots=token_slots)


@pytest.mark.parametrize(
    "config",
    [
        LoRAKernelConfig(block_n=32, split_k=32, block_k=32, num_warps=4),  # many K splits, straddling slices
        LoRAKernelConfig(block_n=64, split_k=256, block_k=64, num_warps=4),  # one K split
        LoRAKernelConfig(block_n=32, split_k=64, block_k=32, num_warps=4, fused=False),  # two launches
        LoRAKernelConfig(block_n=32, split_k=64, block_k=32, num_warps=4, rank_masked_loads=False),
        LoRAKernelConfig(block_n=64, split_k=128, block_k=64, num_warps=4, fused=False, rank_masked_loads=False),
    ],
    ids=["split_k_4", "split_k_1", "two_launches", "unmasked_fused", "unmasked_two_launches"],
)
def test_add_lora_configs(config: LoRAKernelConfig) -> None:
    run_case(
        in_features=128, out_sizes=(48, 16, 16), max_rank=12, ranks=[[12, 2, 9], [0, 12, 3], [5, 5, 0]],
        token_slots=[0, 2, -1, 1, 1, 0, 2, 2, 0, -1, 1], config=config,
    )


@pytest.mark.parametrize("seed", range(10))
def test_random_grid(seed: int) -> None:
    """Random shapes, ranks, adapter counts, slot mixes and kernel forms drawn from the issue's grid."""
    gen = torch.Generator().manual_seed(100 + seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    in_features = pick([64, 128, 192, 320])
    out_sizes = pick([(64,), (64, 32, 32), (96, 96), (200,)])
    max_rank = pick([1, 8, 16, 64])
    num_adapters = int(torch.randint(1, 17, (1,), generator=gen))
    ranks = [[int(torch.randint(0, max_rank + 1, (1,), generator=gen)) for _ in out_sizes] for _ in range(num_adapters)]
    ranks[0] = [max_rank] * len(out_sizes)
    num_tokens = int(torch.randint(1, 41, (1,), generator=gen))
    slots = torch.randint(-1, num_adapters, (num_tokens,), generator=gen).tolist()
    slots[0] = 0
    config = pick([
        None,
        LoRAKernelConfig(block_n=64, split_k=64, block_k=32, num_warps=4),
        LoRAKernelConfig(block_n=64, split_k=256, block_k=64, num_warps=4, fused=False, rank_masked_loads=False),
    ])
    run_case(in_features=in_features, out_sizes=out_sizes, max_rank=max_rank, ranks=ranks, token_slots=slots,
             config=config, block_m=pick([16, 32]), seed=seed)


def test_uneven_segments_prefill() -> None:
    """SGMV: contiguous segments of length 1 and uneven, several tiles per segment, one base segment."""
    seg_lens, seg_slots = [1, 37, 5, 1, 20, 3], [2, 0, -1, 1, 2, 0]
    token_slots = [slot for length, slot in zip(seg_lens, seg_slots, strict=True) for _ in range(length)]
    meta = build_lora_metadata_for_segments(seg_lens, seg_slots, max_loras=3, device="cpu", block_m=16)
    assert meta.token_slots.tolist() == token_slots
    run_case(
        in_features=160, out_sizes=(80,), max_rank=32, ranks=[[32], [1], [12]], token_slots=token_slots,
        block_m=16, config=LoRAKernelConfig(block_n=64, split_k=64, block_k=32, num_warps=4),
    )


def test_large_hidden_small_batch() -> None:
    """hidden 4096 (the benchmark's size) with a decode batch small enough for the interpreter."""
    run_case(
        in_features=4096, out_sizes=(4096,), max_rank=64, ranks=[[64], [8], [16]],
        token_slots=[1, -1, 0, 2], config=LoRAKernelConfig(block_n=512, split_k=1024, block_k=256, num_warps=4),
    )


def test_shrink_and_expand_separately() -> None:
    gen = torch.Generator().manual_seed(3)
    stack = random_stack(
        num_slots=4, max_rank=16, in_features=96, out_sizes=(64, 32), ranks=[[16, 4], [3, 3], [0, 16], [9, 0]],
        dtype=torch.float32, generator=gen,
    )
    meta = build_lora_metadata([3, 0, 1, -1, 2, 2, 0, 3], max_loras=4, device=DEVICE)
    x = torch.randn(8, 96, generator=gen).to(DEVICE)
    shrunk = lora_shrink(x, stack, meta)
    shrunk_ref = lora_shrink_ref(x, stack, meta)
    assert shrunk.shape == (8, 2 * 16)
    assert rel_error(shrunk, shrunk_ref) < 1e-6
    y = torch.randn(8, 96, generator=gen).to(DEVICE)
    got, expected = y.clone(), y.clone()
    lora_expand(shrunk_ref, got, stack, meta)
    lora_expand_ref(shrunk_ref, expected, stack, meta)
    assert rel_error(got - y, expected - y) < 1e-6
    assert not meta.sync.any()


def test_metadata_tiles_cover_each_adapted_token_once() -> None:
    slots = [3, -1, 0, 3, 3, 1, -1, 0] * 9 + [2]
    meta = build_lora_metadata(slots, max_loras=4, device="cpu", block_m=16)
    assert meta.max_tiles == -(-len(slots) // 16) + 4
    seen = []
    for row in meta.tile_table.tolist():
        slot, tokens = row[0], [t for t in row[1:] if t >= 0]
        if slot < 0:
            assert not tokens
            continue
        assert 16 >= len(tokens) >= 1
        assert all(slots[t] == slot for t in tokens)
        seen += tokens
    assert sorted(seen) == [t for t, s in enumerate(slots) if s >= 0]
    assert meta.group_slots.tolist() == [0, 1, 2, 3]


def test_metadata_rejects_slots_out_of_range() -> None:
    with pytest.raises(ValueError):
        build_lora_metadata([0, 4], max_loras=4, device="cpu")


# ---- GPU: compiled kernels, half precision, CUDA graphs -------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("in_features", "out_sizes", "max_rank", "num_adapters", "num_tokens"),
    [
        (4096, (4096,), 64, 8, 64),
        (2048, (2048,), 16, 16, 256),
        (4096, (4096, 1024, 1024), 64, 4, 33),
        (2048, (5632, 5632), 8, 3, 700),
        (64, (64,), 1, 1, 1),
    ],
)
def test_gpu_matches_reference(
    dtype: torch.dtype, in_features: int, out_sizes: tuple[int, ...], max_rank: int, num_adapters: int,
    num_tokens: int,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    ranks = [[max(1, (max_rank >> (s % 4))) for _ in out_sizes] for s in range(num_adapters)]
    slots = torch.randint(-1, num_adapters, (num_tokens,), generator=gen).tolist()
    # bf16 rounds the shrink result and y (8 bits of mantissa); fp16 keeps 11.
    run_case(
        in_features=in_features, out_sizes=out_sizes, max_rank=max_rank, ranks=ranks, token_slots=slots,
        dtype=dtype, tol=2e-2 if dtype == torch.bfloat16 else 4e-3,
    )


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_with_new_metadata() -> None:
    gen = torch.Generator().manual_seed(7)
    stack = random_stack(
        num_slots=8, max_rank=16, in_features=1024, out_sizes=(1024,), ranks=[[16]] * 4 + [[8]] * 4,
        dtype=torch.bfloat16, generator=gen,
    )
    num_tokens = 32
    static_meta = build_lora_metadata([0] * num_tokens, max_loras=8, device=DEVICE)
    x = torch.randn(num_tokens, 1024, generator=gen).to(DEVICE, torch.bfloat16)
    y = torch.zeros(num_tokens, 1024, device=DEVICE, dtype=torch.bfloat16)
    add_lora(y, x, stack, static_meta)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(y, x, stack, static_meta)
    for trial in range(3):
        slots = torch.randint(-1, 8, (num_tokens,), generator=gen).tolist()
        fresh = build_lora_metadata(slots, max_loras=8, device=DEVICE)
        static_meta.copy_(fresh)
        y.zero_()
        graph.replay()
        expected = torch.zeros_like(y)
        add_lora_ref(expected, x, stack, fresh)
        assert rel_error(y, expected) < 2e-2, trial
        assert not static_meta.sync.any()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 256])
def test_gpu_cross_program_handoff_is_race_free(num_tokens: int) -> None:
    """Many K splits and narrow expand programs: the most programs racing on each tile's counters."""
    config = LoRAKernelConfig(block_n=64, split_k=256, block_k=128, num_warps=4)
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        slots = torch.randint(-1, 6, (num_tokens,), generator=gen).tolist()
        run_case(
            in_features=4096, out_sizes=(4096,), max_rank=16, ranks=[[16], [8], [16], [1], [16], [4]],
            token_slots=slots, dtype=torch.bfloat16, config=config, tol=2e-2, seed=seed,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_launches"])
@pytest.mark.parametrize("block_n", [64, 128, 256])
@pytest.mark.parametrize("split_k", [256, 512, 4096])
@pytest.mark.parametrize("num_tokens", [1, 6, 300])
def test_gpu_configs_many_slots(fused: bool, block_n: int, split_k: int, num_tokens: int) -> None:
    """128 resident slots (the benchmark's pool) under every configuration the benchmark sweeps."""
    gen = torch.Generator().manual_seed(block_n + split_k)
    slots = torch.randint(0, 128, (num_tokens,), generator=gen).tolist()
    run_case(
        in_features=4096, out_sizes=(4096,), max_rank=16, ranks=[[16 - (s % 3)] for s in range(128)],
        token_slots=slots, dtype=torch.bfloat16, tol=2e-2,
        config=LoRAKernelConfig(block_n=block_n, split_k=split_k, block_k=128, num_warps=4, fused=fused,
                                rank_masked_loads=num_tokens != 6),
    )


def test_dispatch_matches_reference_on_its_device() -> None:
    """`lora.add_lora` is what the model calls: Triton on CUDA, the reference on the CPU."""
    from loraplex.engine.kernels.lora import add_lora as add_lora_dispatch

    gen = torch.Generator().manual_seed(11)
    stack = random_stack(num_slots=3, max_rank=8, in_features=64, out_sizes=(32, 32), ranks=[[8, 8], [2, 0], [5, 3]],
                         dtype=torch.float32, generator=gen)
    meta = build_lora_metadata([2, -1, 0, 1, 1], max_loras=3, device=DEVICE)
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    y = torch.randn(5, 64, generator=gen).to(DEVICE)
    got, expected = y.clone(), y.clone()
    add_lora_dispatch(got, x, stack, meta)
    add_lora_ref(expected, x, stack, meta)
    assert rel_error(got - y, expected - y) < 1e-5
