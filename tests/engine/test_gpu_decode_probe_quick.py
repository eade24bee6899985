"""The decode probe's --quick mode: its kernels through Triton's interpreter (no GPU needed)."""

from __future__ import annotations

from benchmark_quick import run_quick


def test_gpu_decode_probe_quick() -> None:
    out = run_quick("gpu_decode_probe.py", timeout_s=300)
    assert "checked through the Triton interpreter" in out
