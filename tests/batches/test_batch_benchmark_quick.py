"""benchmarks/batch.py --quick runs (a benchmark that rots fails the suite)."""

from __future__ import annotations

from benchmark_quick import run_quick


def test_batch_benchmark_quick() -> None:
    out = run_quick("batch.py", timeout_s=1500)
    assert "batch_over_online_throughput" in out and "greedy_equal_fraction" in out
    assert "lost_or_duplicated_on_restart" not in out  # quick runs leave the restart to test_batch_restart.py
