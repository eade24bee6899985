"""The structured-output benchmark's quick mode still runs (a benchmark that rots fails CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("constrained_over_unconstrained", "schema_valid_fraction", "mask_fill_us_p50", "mask_fill_us_p99",
        "compile_ms_cold", "compile_ms_cached")


def test_structured_benchmark_quick():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "structured.py"), "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=True,
    )
    metrics = json.loads(result.stdout[result.stdout.index("{"):])
    for key in KEYS:
        assert isinstance(metrics[key], int | float), key
    assert metrics["compile_ms_cached"] < metrics["compile_ms_cold"]
    assert 0.0 <= metrics["schema_valid_fraction"] <= 1.0
    assert metrics["num_mask_fills"] > 0
