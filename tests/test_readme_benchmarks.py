"""The README's benchmark table is the one rendered from benchmarks/results/."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_benchmark_table_matches_results() -> None:
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.table()
    assert "| `engine_cpu` |" in rendered
    assert rendered in (ROOT / "README.md").read_text(), (
        "README.md's benchmark table is stale: run `.venv/bin/python benchmarks/readme_table.py --write`"
    )
