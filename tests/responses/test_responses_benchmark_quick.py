"""The responses benchmark's quick mode runs (same code paths as the full run, smaller sizes)."""

from __future__ import annotations

import pytest
from benchmark_quick import run_quick


@pytest.mark.slow
def test_responses_benchmark_quick():
    stdout = run_quick("responses.py")
    assert "every turn's output identical in all three runs" in stdout
    assert "chained (previous_response_id)" in stdout
