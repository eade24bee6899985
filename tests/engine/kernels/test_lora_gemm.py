"""The decode linear with its LoRA delta in one launch (`lora_gemm`) against F.linear + the reference.

Interpreter on the CPU, compiled on a GPU. Padding past each rank is NaN (`random_stack`), so a
kernel that reads it fails; rows without an adapter must equal the plain product.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex.engine.kernels.lora_gemm import LoRAGemmConfig, linear_with_lora
from loraplex.engine.kernels.lora_metadata import build_lora_metadata
from loraplex.engine.kernels.lora_reference import add_lora_ref
from test_lora_kernels import DEVICE, random_stack, rel_error


def run_case(*, in_features: int, out_sizes: tuple[int, ...], max_rank: int, ranks: list[list[int]],
             token_slots: list[int], dtype: torch.dtype = torch.float32, config: LoRAGemmConfig | None = None,
             max_loras: int | None = None, seed: int = 0, tol: float = 1e-5) -> None:
    gen = torch.Generator().manual_seed(seed)
    slots = max_loras or len(ranks)
    stack = random_stack(num_slots=slots, max_rank=max_rank, in_features=in_features, out_sizes=out_sizes,
                         ranks=ranks + [[0] * len(out_sizes)] * (slots - len(ranks)), dtype=dtype, generator=gen)
    meta = build_lora_metadata(token_slots, max_loras=slots, device=DEVICE)
    x = torch.randn(len(token_slots), in_features, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(sum(out_sizes), in_features, generator=gen) / in_features**0.5).to(DEVICE, dtype)
    base = F.linear(x.double(), w.double())
    expected = F.linear(x, w)
    add_lora_ref(expected, x, stack, meta)
    delta_expected = expected.double() - F.linear(x, w).double()
    out = torch.full((len(token_slots), sum(out_sizes)), float("nan"), dtype=dtype, device=DEVICE)
    got = linear_with_lora(x, w, stack, meta, config=config, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert rel_error(got, expected) < tol
    if delta_expected.norm() > 0:
        assert rel_error(got.double() - base, delta_expected) < max(tol * 50, 1e-4)
    no_adapter = torch.tensor(token_slots, device=DEVICE) < 0
    if no_adapter.any():
        assert rel_error(got[no_adapter], base[no_adapter]) < tol
    assert not meta.sync.any(), "the kernel must leave its counters zeroed"


SMALL = LoRAGemmConfig(block_n=32, block_k=32, num_warps=4, num_stages=2, split_k=32, shrink_block_k=32, g_chunk=2)
SPLIT = LoRAGemmConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=64, shrink_block_k=32, g_chunk=4,
                       gemm_splits=3)

CASES = {
    # name: (in, out_sizes, max_rank, ranks per slot, token slots, config)
    "one_slice_mixed": (64, (64,), 16, [[16], [1], [7]], [2, 0, -1, 1, 0, 2, -1, 2], SMALL),
    "qkv_slices_ranks": (96, (64, 32, 32), 16, [[16, 8, 16], [4, 0, 4], [1, 1, 1]], [0, 1, 2, 2, 1, -1, 0], SMALL),
    "gate_up_rank32": (64, (96, 96), 32, [[32, 32], [5, 17]], [1, 0, 1, 1, 0], SMALL),
    "all_base_rows": (64, (64,), 8, [[8], [8]], [-1, -1, -1], SMALL),
    "odd_k_default_config": (200, (64,), 8, [[8], [3]], [1, 1, 0, -1, 0, 1, 1], None),
    "more_groups_than_chunk": (64, (32,), 16, [[1 + (s * 3) % 16] for s in range(9)], [*range(9), -1, 4], SMALL),
    "unused_slots_in_pool": (64, (64, 64), 16, [[16, 16], [4, 2]], [1, -1, 1, 0], SMALL),
    "gemm_split_k_qkv": (96, (64, 32, 32), 16, [[16, 8, 16], [4, 0, 4], [1, 1, 1]], [0, 1, 2, 2, 1, -1, 0], SPLIT),
    "gemm_split_k_uneven_k": (200, (48,), 8, [[8], [3]], [1, -1, 0, 1], SPLIT),
    "five_groups_two_chunks": (64, (32, 32), 16, [[1 + (s * 5) % 16, 16] for s in range(5)],
                               [4, -1, 0, 1, 2, 3, 4, 0], SMALL),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_linear_with_lora_matches_reference(name: str) -> None:
    in_features, out_sizes, max_rank, ranks, token_slots, config = CASES[name]
    run_case(in_features=in_features, out_sizes=out_sizes, max_rank=max_rank, ranks=ranks,
             token_slots=token_slots, config=config, max_loras=8 if name == "unused_slots_in_pool" else None)


@pytest.mark.parametrize(("in_features", "out_sizes"), [(576, (576, 192, 192)), (576, (576,)), (576, (1536, 1536)),
                                                      (1536, (576,))], ids=["qkv", "o", "gate_up", "down"])
def test_the_configs_tuned_for_smollm2_compute_its_linears(in_features: int, out_sizes: tuple[int, ...]) -> None:
    """Each SmolLM2 entry of TUNED on that model's real layer shape (a few rows over three adapters and the base)."""
    from loraplex.engine.kernels.lora_gemm import TUNED

    config = TUNED[(sum(out_sizes), in_features)]
    ranks = [[8] * len(out_sizes), [4] * len(out_sizes), [1] * len(out_sizes)]
    run_case(in_features=in_features, out_sizes=out_sizes, max_rank=8, ranks=ranks, token_slots=[0, 1, -1, 2, 0],
             config=config)


def test_full_tile_of_rows_half() -> None:
    """16 rows (an even BLOCK_M tile), half operands, K split in several shrink programs (fp16 here: the
    CPU interpreter mis-converts bf16; the GPU tests below run bf16)."""
    slots = [s % 5 - 1 for s in range(16)]
    run_case(in_features=128, out_sizes=(64, 32, 32), max_rank=16, ranks=[[16, 16, 16], [8, 0, 4], [2, 2, 2], [16, 1, 0]],
             token_slots=slots, dtype=torch.float16 if DEVICE == "cpu" else torch.bfloat16, config=SMALL, tol=2e-2)


@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["one_split", "split_k"])
def test_plain_product_without_lora(config: LoRAGemmConfig) -> None:
    gen = torch.Generator().manual_seed(7)
    stack = random_stack(num_slots=2, max_rank=8, in_features=96, out_sizes=(64,), ranks=[[8], [4]],
                         dtype=torch.float32, generator=gen)
    meta = build_lora_metadata([0, 1, 0], max_loras=2, device=DEVICE)
    x = torch.randn(3, 96, generator=gen).to(DEVICE)
    w = torch.randn(64, 96, generator=gen).to(DEVICE)
    got = linear_with_lora(x, w, stack, meta, config=config, has_lora=False)
    assert rel_error(got, F.linear(x.double(), w.double())) < 1e-5
    assert not meta.sync.any()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [33, 64])
@pytest.mark.parametrize("num_adapters", [8, 64])
def test_llama_shapes_on_gpu(rows: int, num_adapters: int) -> None:
    """The benchmark's shapes (hidden 4096, rank 16, a 64-slot pool) at the tuned configs."""
    gen = torch.Generator().manual_seed(rows + num_adapters)
    slots = torch.randint(-1, min(num_adapters, rows), (rows,), generator=gen).tolist()
    for out_sizes, in_features in (((4096, 1024, 1024), 4096), ((14336, 14336), 4096), ((4096,), 14336)):
        for config in (None, LoRAGemmConfig(block_n=128, gemm_splits=4)):
            run_case(in_features=in_features, out_sizes=out_sizes, max_rank=16,
                     ranks=[[16] * len(out_sizes)] * num_adapters, token_slots=slots, dtype=torch.bfloat16,
                     max_loras=64, tol=1e-2, config=config)
