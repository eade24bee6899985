"""The serving benchmark's quick mode runs end to end on the CPU (so the benchmark cannot rot)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_quick import run_quick


def test_serving_quick(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    run_quick("serving.py", "--device", "cpu", "--out", str(out), timeout_s=1200)
    report = json.loads(out.read_text())
    assert report["checked"] is True and report["benchmark"] == "serving"
    metrics = report["metrics"]
    assert metrics["checked_requests"] == 4  # plain, schema, adapter, and the adapter's prompt on the base
    for key in ("ttft_added_ms_p50_at_80pct", "tpot_ratio_p50_at_80pct", "saturation_throughput_ratio",
                "long_stream_over_engine_throughput", "tiny_requests_per_s_1_api_servers",
                "engine_core_cpu_ms_per_tiny_request", "ttft_ms_p50_http_fixed_0.8x", "ttft_ms_p50_engine_fixed_0.8x",
                "tpot_ms_p50_http_fixed_0.8x", "itl_ms_p99_http_fixed_0.8x", "output_tokens_per_s_http_chat_inf",
                "client_cpu_max_fraction"):
        assert isinstance(metrics[key], int | float), key
    assert metrics["errors"] == 0
    assert metrics["output_tokens_per_s_http_fixed_inf"] > 0 and metrics["output_tokens_per_s_engine_fixed_inf"] > 0
