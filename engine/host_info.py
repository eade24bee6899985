"""What machine this is, as benchmarks record it and as native builds key their caches."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any


def cpu_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_benchmark_machine() -> dict[str, Any]:
    """The `machine` entry of a CPU benchmark's result. Call it when the run ends: the load average then
    says whether other work shared the CPU while it was measured."""
    import os

    import torch

    return {"cpu": cpu_model_name(), "cores": os.cpu_count(), "gpu": None, "torch": torch.__version__.split("+")[0],
            "python": platform.python_version(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
