"""The fused Triton ops of the CUDA runner against their PyTorch references."""

from __future__ import annotations

import pytest
import torch
from loraplex.engine.cuda.fused_ops import rms_norm, rms_norm_reference, rotary_, rotary_reference

pytestmark = pytest.mark.gpu


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 2048), (33, 4096), (5, 3, 128)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3
    weight = torch.randn(shape[-1], device="cuda", dtype=dtype)
    assert relative_error(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5)) < (
        1e-6 if dtype == torch.float32 else 8e-3
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (32, 8, 128), (32, 8, 64), (6, 6, 32)])
def test_rotary_on_strided_views(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    tokens = 19
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, 1, head_dim, device="cuda") * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_reference(q_ref, k_ref, cos, sin)
    untouched = qkv[:, (heads + kv_heads) * head_dim :].clone()
    rotary_(q, k, cos, sin)
    bound = 1e-6 if dtype == torch.float32 else 8e-3
    assert relative_error(q, q_ref) < bound and relative_error(k, k_ref) < bound
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], untouched)  # v is not touched
