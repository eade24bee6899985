"""Run a benchmark script's `--quick` mode as CI does, so a benchmark that rots fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_quick(script: str, *args: str, timeout_s: float = 900, cpu_only: bool = False) -> str:
    """stdout of `python benchmarks/<script> --quick <args>`, run from the repository root; fails on exit != 0.

    A script run by path puts `benchmarks/` (not the root) first on sys.path, so `platform/` never
    shadows the standard library. `cpu_only`: no GPU is visible to it, so a script whose quick mode is its
    CPU check (the kernels through Triton's interpreter) runs that check on a GPU machine too.
    """
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"} if cpu_only else None
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
