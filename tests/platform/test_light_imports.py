"""The processes of `loraplex serve` that do no tensor math load no torch: the supervisor (it only watches its
children) and the batch worker (it talks HTTP and SQL). Each import of torch there cost ~1.5 s of CPU at every
start and ~190 MB of memory for the life of the process."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["loraplex.platform.supervisor", "loraplex.platform.batches.worker",
                                    "loraplex.platform.cli.main", "loraplex.engine.core.mp_client"])
def test_module_imports_without_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} loads {out.stdout.strip()}"
