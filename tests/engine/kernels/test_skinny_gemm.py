"""The skinny GEMM (2-128 rows) against float64 `F.linear`: one launch and K split over programs with the
partials summed in order, uneven N and K, bias, every row-tile size; its table lookup; and, on a GPU, the
CUDA runner's `decode_linear` routing a few rows through it, also inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex.engine.cuda import skinny_gemm as skinny_module
from loraplex.engine.cuda.skinny_gemm import SkinnyConfig, config_for, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's tensor-core dot is exact in float32 and float16 (bfloat16 has no NumPy type); on a GPU a
# float32 dot runs as TF32, so float32 is not what the kernel is for there (decode_linear keeps cuBLAS for it).
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def bound(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 8e-3


CASES = [  # rows, N, K, config, bias
    (2, 96, 64, SkinnyConfig(block_n=32, block_k=32, num_warps=4, num_stages=2), False),
    (5, 100, 72, SkinnyConfig(block_n=32, block_k=32, num_warps=4, num_stages=2, splits=3), True),  # uneven N, K
    (16, 64, 256, SkinnyConfig(block_n=64, block_k=64, num_warps=4, num_stages=2, splits=2), False),
    (17, 48, 40, SkinnyConfig(block_n=16, block_k=16, num_warps=4, num_stages=2), True),  # a 32-row tile
    (64, 64, 128, SkinnyConfig(block_n=32, block_k=64, num_warps=4, num_stages=2, splits=8), True),
    (100, 40, 48, SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, splits=2), False),  # 64 + 64
    (80, 24, 64, SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2), True),  # 64 rows + 16
    (1, 32, 64, SkinnyConfig(block_n=32, block_k=32, num_warps=4, num_stages=2), False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k", "config", "bias"), CASES)
def test_skinny_gemm_matches_float64(dtype: torch.dtype, rows: int, n: int, k: int, config: SkinnyConfig,
                                     bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    out = skinny_gemm(x, weight, b, config=config)
    assert out.shape == (rows, n) and out.dtype == dtype
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert relative_error(out, expected) < bound(dtype)
    assert torch.equal(skinny_gemm(x, weight, b, config=config), out)  # split partials summed in a fixed order


def test_skinny_gemm_reads_strided_rows() -> None:
    """A view whose rows are strided (a slice of a wider activation) reads as its contiguous copy."""
    dtype = DTYPES[-1]
    wide = torch.randn(6, 80, device=DEVICE).to(dtype)
    x = wide[:, 8:72]
    weight = (torch.randn(40, 64, device=DEVICE) / 8).to(dtype)
    config = SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, splits=2)
    assert torch.equal(skinny_gemm(x, weight, config=config), skinny_gemm(x.contiguous(), weight, config=config))


def test_skinny_gemm_refuses_what_it_is_not_for() -> None:
    weight = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm(torch.randn(skinny_module.MAX_ROWS + 1, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm(torch.randn(4, 12, device=DEVICE), weight)


def test_config_for_takes_the_first_row_bound_that_covers(monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = SkinnyConfig(block_n=64, splits=4), SkinnyConfig(block_n=128)
    monkeypatch.setattr(skinny_module, "TUNED", {(256, 512): ((16, small), (48, None), (128, large))})
    assert config_for(2, 256, 512) is small and config_for(16, 256, 512) is small
    assert config_for(17, 256, 512) is None and config_for(48, 256, 512) is None  # cuBLAS measured faster there
    assert config_for(80, 256, 512) is large and config_for(128, 256, 512) is large
    assert config_for(129, 256, 512) is None and config_for(8, 512, 256) is None  # past the table, other shapes


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 48, 80])
def test_decode_linear_routes_tuned_shapes_through_the_skinny_gemm_in_a_graph(
        monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    from loraplex.engine.cuda.gemv import decode_linear

    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) / 512**0.5
    bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    config = SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, splits=2)
    monkeypatch.setattr(skinny_module, "TUNED", {(384, 512): ((128, config),)})
    direct = skinny_gemm(x, weight, bias, config=config)
    assert torch.equal(decode_linear(x, weight, bias), direct)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_linear(static_x, weight, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_linear(static_x, weight, bias)
    static_x.copy_(x * 2)
    graph.replay()
    assert torch.equal(captured, skinny_gemm(x * 2, weight, bias, config=config))
    monkeypatch.setattr(skinny_module, "TUNED", {})
    assert torch.equal(decode_linear(x, weight, bias), F.linear(x, weight, bias))  # untuned: cuBLAS
