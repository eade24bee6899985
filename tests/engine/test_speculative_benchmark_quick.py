"""The speculative-decoding benchmark's quick mode runs end to end and its checks hold."""

from __future__ import annotations

from pathlib import Path

from benchmark_quick import run_quick


def test_speculative_benchmark_quick(smollm_path: Path) -> None:
    lines = run_quick("speculative.py", timeout_s=600)
    assert "grounded batch 1:" in lines and "open batch 8:" in lines
    assert "checks: identical and no leak True; grounded prompts accept drafts True" in lines
