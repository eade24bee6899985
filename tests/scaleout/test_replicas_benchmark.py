"""benchmarks/replicas.py --quick on the CPU: two replicas behind HAProxy, against one, and one killed."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from benchmark_quick import run_quick


@pytest.mark.skipif(subprocess.run(["which", "haproxy"], capture_output=True).returncode != 0,
                    reason="haproxy is not installed (make test installs it)")
def test_quick_mode_runs_every_phase() -> None:
    out = run_quick("replicas.py")
    metrics = json.loads(re.search(r"^\{\n.*?^\}$", out, re.S | re.M).group(0))  # type: ignore[union-attr]
    assert metrics["aggregate_throughput_ratio_2_replicas"] > 0
    assert metrics["session_turn3_ttft_ratio_2_replicas"] > 0
    assert metrics["requests_served_after_kill"] > 0
    assert metrics["lost_requests_on_replica_kill"] == 0, out
