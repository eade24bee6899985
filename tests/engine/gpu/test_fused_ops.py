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


@pytest.mark.parametrize("mode", ["delta", "shrink"])
@pytest.mark.parametrize("graph", [False, True])
def test_lora_beside_the_gemm_matches_after(mode: str, graph: bool) -> None:
    """A LoRALinear with the runner's side-stream LoRA batch gives the reference's output, eagerly and
    replayed from a CUDA graph (fork and join captured as graph edges)."""
    from loraplex.engine.context import StepContext
    from loraplex.engine.cuda.lora_overlap import SideStreamLoRABatch
    from loraplex.engine.kernels.lora_metadata import build_lora_metadata
    from loraplex.engine.kernels.lora_reference import add_lora_ref
    from loraplex.engine.kernels.lora_triton import add_lora
    from loraplex.engine.kernels.lora_weights import LoRAStack
    from loraplex.engine.model.layers import LoRALinear

    torch.manual_seed(0)
    hidden, sizes, tokens = 256, [("q_proj", 128), ("k_proj", 64), ("v_proj", 64)], 24
    linear = LoRALinear(hidden, sizes, layer_index=0).cuda().requires_grad_(False)
    linear.weight.normal_(0, 0.05)
    stack = LoRAStack.allocate(num_slots=4, max_rank=16, in_features=hidden, out_sizes=(128, 64, 64),
                               dtype=torch.float32, device="cuda")
    for slot in range(4):
        for i, (_, size) in enumerate(sizes):
            stack.set_slot(slot, i, torch.randn(8 + slot, hidden, device="cuda") * 0.1,
                           torch.randn(size, 8 + slot, device="cuda") * 0.1, 0.5 + slot)
    slots = [i % 5 - 1 for i in range(tokens)]  # -1 (no adapter) and every slot
    meta = build_lora_metadata(slots, max_loras=4, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda")
    expected = torch.nn.functional.linear(x, linear.weight)
    add_lora_ref(expected, x, stack, meta)
    batch = SideStreamLoRABatch(meta, {(0, linear.slices): stack}, add_lora, torch.cuda.Stream(), mode)
    ctx = StepContext(attention=None, cos=None, sin=None, backend=None, lora=batch)
    if graph:
        out = linear(x, ctx)  # compile outside the capture
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            out = linear(x, ctx)
        x.copy_(torch.randn_like(x))
        expected = torch.nn.functional.linear(x, linear.weight)
        add_lora_ref(expected, x, stack, meta)
        captured.replay()
    else:
        out = linear(x, ctx)
    torch.cuda.synchronize()
    assert relative_error(out, expected) < 1e-5
