"""The engine CPU benchmark's quick mode runs end to end and its output checks hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_cpu_benchmark_quick(smollm_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_cpu.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout
    assert "throughput:" in lines and "'identical': 8" in lines
    assert "batch-1 decode:" in lines and "tokens equal True" in lines
    assert "prefix TTFT:" in lines and "first tokens equal True" in lines
