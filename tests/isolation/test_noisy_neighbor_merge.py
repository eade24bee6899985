"""`benchmarks/noisy_neighbor.py --merge`: rerun attacks replace their own figures and keep everything else,
the GPU run's figures and targets included (a lent GPU writes those; a CPU rerun cannot remake them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "noisy_neighbor.py"
_spec = importlib.util.spec_from_file_location("noisy_neighbor_bench", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_a_merge_replaces_the_rerun_attacks_and_keeps_the_gpu_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    result = tmp_path / "noisy_neighbor.json"
    gpu_targets = {"gpu_flood_victim_ttft_p95_ratio": {"op": "<=", "value": 2.0},
                   "gpu_flood_total_throughput_ratio": {"op": ">=", "value": 0.9}}
    result.write_text(json.dumps({
        "date": "2026-01-01T00:00:00+00:00", "config": {"gpu_flood": {"date": "2026-01-02"}},
        "metrics": {"victim_p95_ratio_flood_long_streams": 1.4, "victim_p95_ratio_upload_bomb": 1.2,
                    "gpu_flood_total_throughput_ratio": 0.97},
        "targets": {"victim_p95_ratio_worst": {"op": "<=", "value": 1.5}, **gpu_targets}}))
    monkeypatch.setattr(bench, "RESULT", result)
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # where the run says it wrote
    bench.merge_into_results(["flood_long_streams"], {"victim_p95_ratio_flood_long_streams": 1.1}, 0.3)
    merged = json.loads(result.read_text())
    assert merged["metrics"]["victim_p95_ratio_flood_long_streams"] == 1.1
    assert merged["metrics"]["victim_p95_ratio_upload_bomb"] == 1.2
    assert merged["metrics"]["victim_p95_ratio_worst"] == 1.2
    assert merged["metrics"]["gpu_flood_total_throughput_ratio"] == 0.97
    assert {k: merged["targets"][k] for k in gpu_targets} == gpu_targets
    assert merged["config"]["gpu_flood"] == {"date": "2026-01-02"}
    assert merged["config"]["attack_dates"]["upload_bomb"] == "2026-01-01T00:00:00+00:00"
