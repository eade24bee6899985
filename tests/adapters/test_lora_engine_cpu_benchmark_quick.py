"""benchmarks/lora_engine_cpu.py --quick runs end to end (a benchmark that rots fails the suite)."""

from __future__ import annotations

from benchmark_quick import run_quick


def test_lora_engine_cpu_benchmark_quick() -> None:
    out = run_quick("lora_engine_cpu.py", timeout_s=600)
    assert "throughput ratio vs PEFT" in out and "LoRA overhead" in out
