"""The billing benchmark's quick mode runs (same code paths as the full run, smaller sizes)."""

from __future__ import annotations

import pytest
from benchmark_quick import run_quick


@pytest.mark.slow
def test_billing_benchmark_quick():
    stdout = run_quick("billing.py")
    for key in ("metering_overhead_ms_p50", "metering_overhead_ms_p99", "ledger_writes_per_s_postgres"):
        assert key in stdout
