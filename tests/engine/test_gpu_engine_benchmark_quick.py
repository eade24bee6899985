"""benchmarks/gpu_engine.py --quick runs on the CPU (a benchmark that rots fails the suite)."""

from __future__ import annotations

from benchmark_quick import run_quick


def test_gpu_engine_benchmark_quick() -> None:
    out = run_quick("gpu_engine.py", timeout_s=600)
    assert "host-split timer on a tiny CPU engine" in out
