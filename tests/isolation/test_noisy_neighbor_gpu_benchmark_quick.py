"""benchmarks/noisy_neighbor_gpu.py --quick runs on the CPU at small sizes (a benchmark that rots fails the
suite): the flood phase serves its requests and the victim's, none failing."""

from __future__ import annotations

import re

from benchmark_quick import run_quick


def test_noisy_neighbor_gpu_benchmark_quick() -> None:
    out = run_quick("noisy_neighbor_gpu.py", timeout_s=600)
    errors = re.search(r"^gpu_flood_victim_errors\s+(\S+)$", out, re.MULTILINE)
    assert errors is not None, out[-2000:]
    assert float(errors.group(1)) == 0
    assert "gpu_flood_victim_ttft_p95_ratio" in out
