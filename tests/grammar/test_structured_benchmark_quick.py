"""The structured-output benchmark's quick mode still runs (a benchmark that rots fails CI)."""

from __future__ import annotations

import json

from benchmark_quick import run_quick

KEYS = ("constrained_over_unconstrained", "jump_forward_over_unconstrained", "schema_valid_fraction", "mask_fill_us_p50", "mask_fill_us_p99",
        "compile_ms_cold", "compile_ms_cached")


def test_structured_benchmark_quick():
    stdout = run_quick("structured.py")
    metrics = json.loads(stdout[stdout.index("{"):])
    for key in KEYS:
        assert isinstance(metrics[key], int | float), key
    assert metrics["compile_ms_cached"] < metrics["compile_ms_cold"]
    assert metrics["schema_valid_fraction"] == 1.0  # every output, length finishes included, validates
    assert metrics["num_mask_fills"] > 0
