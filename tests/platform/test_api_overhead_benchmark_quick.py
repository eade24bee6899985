"""The API-overhead benchmark's quick mode runs end to end (so the benchmark cannot rot)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_quick import run_quick


def test_api_overhead_quick(tmp_path: Path) -> None:
    out = tmp_path / "api_overhead.json"
    run_quick("api_overhead.py", "--device", "cpu", "--out", str(out), timeout_s=900)
    report = json.loads(out.read_text())
    assert report["checked"] is True and report["benchmark"] == "api_overhead"
    metrics = report["metrics"]
    for key in ("p50_added_ms_per_request", "p50_added_ms_per_token", "p50_added_ms_per_request_8",
                "http_over_inprocess_throughput_8", "tiny_requests_per_s_2_api_servers"):
        assert isinstance(metrics[key], int | float)
    assert metrics["errors_at_8_streams"] == 0
