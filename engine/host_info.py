"""What machine this is, as benchmarks record it and as native builds key their caches."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
