"""The sessions benchmark's quick mode runs (same code paths as the full run, smaller sizes)."""

from __future__ import annotations

import pytest
from benchmark_quick import run_quick


@pytest.mark.slow
def test_sessions_benchmark_quick():
    stdout = run_quick("sessions.py")
    assert "pinned session" in stdout and "restored from host" in stdout
