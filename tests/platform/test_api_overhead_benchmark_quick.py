"""The API-overhead benchmark's quick mode runs end to end (so the benchmark cannot rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_api_overhead_quick(tmp_path: Path) -> None:
    out = tmp_path / "api_overhead.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/api_overhead.py", "--quick", "--device", "cpu", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["checked"] is True and report["benchmark"] == "api_overhead"
    metrics = report["metrics"]
    for key in ("p50_added_ms_per_request", "p50_added_ms_per_token", "errors_at_64_streams"):
        assert isinstance(metrics[key], int | float)
    assert metrics["errors_at_64_streams"] == 0
