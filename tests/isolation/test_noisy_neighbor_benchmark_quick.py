"""The noisy-neighbour benchmark's quick mode runs (same code paths as the full run, smaller sizes)."""

from __future__ import annotations

import pytest
from benchmark_quick import run_quick


@pytest.mark.slow
def test_noisy_neighbor_benchmark_quick():
    stdout = run_quick("noisy_neighbor.py")
    for key in ("victim_p95_ratio_worst", "victim_p95_ratio_stop_strings", "victim_p95_ratio_big_body",
                "victim_p95_ratio_plain_generation",
                "victim_p95_ratio_upload_bomb", "victim_quiet_p95_s"):
        assert key in stdout
