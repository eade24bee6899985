"""The engine CPU benchmark's quick mode runs end to end and its output checks hold."""

from __future__ import annotations

from pathlib import Path

from benchmark_quick import run_quick


def test_engine_cpu_benchmark_quick(smollm_path: Path) -> None:
    lines = run_quick("engine_cpu.py", timeout_s=300)
    assert "throughput:" in lines and "'identical': 8" in lines
    assert "batch-1 decode:" in lines and "tokens equal True" in lines
    assert "prefix TTFT:" in lines and "first tokens equal True" in lines
