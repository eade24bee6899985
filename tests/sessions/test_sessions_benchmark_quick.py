"""The sessions benchmark's quick mode runs (same code paths as the full run, smaller sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sessions_benchmark_quick():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sessions.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pinned session" in done.stdout and "restored from host" in done.stdout
