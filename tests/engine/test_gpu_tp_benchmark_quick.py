"""The tensor-parallel benchmark's quick mode (CPU, gloo) runs end to end and its check holds."""

from __future__ import annotations

from benchmark_quick import run_quick


def test_gpu_tp_benchmark_quick() -> None:
    lines = run_quick("gpu_tp.py", timeout_s=300)
    assert "tokens equal True" in lines
