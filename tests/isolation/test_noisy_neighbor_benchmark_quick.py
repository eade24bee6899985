"""The noisy-neighbour suite: the benchmark's quick mode, one phase per hostile pattern, fails when the victim's p95
under an attack passes max(3x its quiet p95, quiet + 1 s), when a victim request fails, when the server's memory
grows past its bound, or when an attack is not answered as it must be (4xx naming the parameter, or served in
full)."""

from __future__ import annotations

import pytest
from benchmark_quick import run_quick


@pytest.mark.slow
@pytest.mark.timing  # the victim's latency bound: run alone (make test)
def test_noisy_neighbor_benchmark_quick():
    stdout = run_quick("noisy_neighbor.py")
    for attack in ("stop_strings", "plain_generation", "big_body", "upload_bomb", "prompt_list", "many_tools",
                   "deep_schema", "logit_bias", "wide_choices"):
        for key in (f"victim_p95_ratio_{attack}", f"server_memory_growth_mb_{attack}", f"num_attack_requests_{attack}"):
            assert key in stdout
    assert "victim_p95_ratio_worst" in stdout and "victim_quiet_p95_s" in stdout
    assert "suite bound broken" not in stdout
