"""The kernel benchmarks' quick modes run on the CPU (Triton's interpreter against the PyTorch references):
a benchmark that rots fails the suite, not the next GPU session."""

from __future__ import annotations

from benchmark_quick import run_quick


def test_attention_kernels_benchmark_quick() -> None:
    out = run_quick("attention_kernels.py", timeout_s=300, cpu_only=True)
    assert "kernels checked through the Triton interpreter" in out


def test_lora_kernels_benchmark_quick() -> None:
    out = run_quick("lora_kernels.py", timeout_s=300, cpu_only=True)
    assert "cases checked" in out
