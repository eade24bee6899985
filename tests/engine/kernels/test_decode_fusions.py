"""The CUDA runner's fused decode ops against their PyTorch references: residual add + RMSNorm,
SiLU x mul, rotary + paged K/V write, and the batch-1 GEMV (interpreter on the CPU, compiled on
a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex.engine.cuda.fused_ops import (
    add_rms_norm_,
    rotary_reference,
    rotary_write_kv_,
    silu_mul,
    silu_mul_reference,
)
from loraplex.engine.cuda.gemv import gemv
from loraplex.engine.model.layers import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def bound(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 8e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (3, 2, 48)])
def test_add_rms_norm_updates_the_residual(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, device=DEVICE, dtype=dtype) * 2
    residual = torch.randn(shape, device=DEVICE, dtype=dtype)
    norm = RMSNorm(shape[-1], 1e-5).to(device=DEVICE, dtype=dtype).requires_grad_(False)
    norm.weight.data = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
    expected, expected_sum = norm(x, residual.clone())
    out, updated = add_rms_norm_(x, residual, norm.weight, 1e-5)
    assert updated is residual
    assert torch.equal(residual, expected_sum)  # the add rounds exactly as `x + residual`
    assert relative_error(out, expected) < bound(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 64), (4, 100), (2, 3000)])
def test_silu_mul(dtype: torch.dtype, rows: int, width: int) -> None:
    gate_up = torch.randn(rows, 2 * width, device=DEVICE, dtype=dtype) * 3
    assert relative_error(silu_mul(gate_up), silu_mul_reference(gate_up)) < bound(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (6, 6, 32)])
def test_rotary_write_kv(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    tokens, block_size, num_blocks = 7, 4, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    angles = torch.rand(tokens, 1, head_dim, device=DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 0, -1, 17, 9, 12, -1], dtype=torch.int32, device=DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.full(shape, 7.0, device=DEVICE, dtype=dtype)
    value_cache = torch.full(shape, 7.0, device=DEVICE, dtype=dtype)
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()
    rotary_reference(q_ref, k_ref, cos, sin)
    key_ref, value_ref = key_cache.clone().view(-1, kv_heads, head_dim), value_cache.clone().view(-1, kv_heads, head_dim)
    written = slots >= 0
    key_ref[slots[written].long()] = k_ref[written]
    value_ref[slots[written].long()] = v_ref[written]
    rotary_write_kv_(q, k, v, cos, sin, key_cache, value_cache, slots)
    assert relative_error(q, q_ref) < bound(dtype) and relative_error(k, k_ref) < bound(dtype)
    assert relative_error(key_cache.view_as(key_ref), key_ref) < bound(dtype)
    assert torch.equal(value_cache.view_as(value_ref), value_ref)  # v is copied, untouched slots keep 7.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "bias"), [(64, 128, False), (37, 96, True), (24, 1000, False)])
def test_gemv(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)
    weight = torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5
    b = torch.randn(n, device=DEVICE, dtype=dtype) if bias else None
    out = gemv(x, weight, b, config=(8, 64, 4, 2))
    assert out.shape == (1, n) and out.dtype == dtype
    assert relative_error(out, F.linear(x.double(), weight.double(), None if b is None else b.double())) < bound(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [576, 1536])
def test_the_gemv_configs_tuned_for_small_layers_compute_the_linear(dtype: torch.dtype, k: int) -> None:
    """SmolLM2's tuned config (2 weight rows a program, K read in 1024-wide tiles: one tile at 576, a masked
    second at 1536) on a few output rows of its real K."""
    from loraplex.engine.cuda.gemv import TUNED

    config = TUNED[(576, k)]
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)
    weight = torch.randn(7, k, device=DEVICE, dtype=dtype) / k**0.5  # an odd N: the last program's rows clamped
    out = gemv(x, weight, config=config)
    assert relative_error(out, F.linear(x.double(), weight.double())) < bound(dtype)


@pytest.mark.gpu
def test_decode_linear_keeps_cublas_at_one_row_where_it_is_faster() -> None:
    """SmolLM2's LM head at one row goes to cuBLAS (the GEMV took 28.8 µs there against 17.6 on an H200); a
    tuned layer shape goes to the GEMV."""
    from loraplex.engine.cuda.gemv import CUBLAS_AT_ONE_ROW, TUNED, decode_linear

    assert (49152, 576) in CUBLAS_AT_ONE_ROW and (960, 576) in TUNED
    head = torch.randn(49152, 576, device="cuda", dtype=torch.bfloat16) / 24
    x = torch.randn(1, 576, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(decode_linear(x, head), F.linear(x, head))
    qkv = torch.randn(960, 576, device="cuda", dtype=torch.bfloat16) / 24
    assert torch.equal(decode_linear(x, qkv), gemv(x, qkv))


def test_fuse_model_swaps_and_restores() -> None:
    """fuse_model installs the fused ops without renaming any parameter, is idempotent, and puts the
    PyTorch modules back when asked (the probe benchmark compares both on one model)."""
    import dataclasses

    from loraplex.engine.cuda.fused_ops import TritonRMSNorm, TritonSiluAndMul, fuse_model
    from loraplex.engine.cuda.gemv import decode_linear
    from loraplex.engine.cuda.random_weights import named_config
    from loraplex.engine.model.layers import SiluAndMul
    from loraplex.engine.model.llama import LlamaForCausalLM

    config = dataclasses.replace(named_config("Llama-3.1-8B"), num_hidden_layers=2, hidden_size=64,
                                 intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 vocab_size=100)
    model = LlamaForCausalLM(config, 64)
    names = sorted(n for n, _ in model.named_parameters())
    fuse_model(model)
    fuse_model(model)
    assert sorted(n for n, _ in model.named_parameters()) == names
    assert sum(isinstance(m, TritonRMSNorm) for m in model.modules()) == 5
    assert sum(isinstance(m, TritonSiluAndMul) for m in model.modules()) == 2
    assert model.layers[0].mlp.gate_up_proj.matmul is decode_linear and model.lm_head.matmul is decode_linear
    fuse_model(model, elementwise=False, gemv=False)
    assert sum(isinstance(m, RMSNorm) for m in model.modules()) == 5
    assert sum(isinstance(m, SiluAndMul) for m in model.modules()) == 2
    assert not any(isinstance(m, TritonRMSNorm | TritonSiluAndMul) for m in model.modules())
    assert all("matmul" not in m.__dict__ for m in model.modules())
