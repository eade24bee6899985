"""The billing benchmark's quick mode runs (same code paths as the full run, smaller sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_billing_benchmark_quick():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "billing.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for key in ("metering_overhead_ms_p50", "metering_overhead_ms_p99", "ledger_writes_per_s_postgres"):
        assert key in done.stdout
