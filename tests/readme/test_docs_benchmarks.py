"""The benchmarks page: one current table per results file, with its machine, date and method."""

from __future__ import annotations

import json
import re

from docs_site import generated
from readme_examples import REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results"


def test_every_results_file_with_figures_has_its_table() -> None:
    tables = generated().results_table()
    rendered = tables.markdown()
    assert "<!-- generated: benchmarks -->" in (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    sections = dict(re.findall(r"^## `(\w+)`\n(.*?)(?=^## |\Z)", rendered, re.M | re.S))
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        figures = {k: v for k, v in data.get("metrics", {}).items() if tables.is_figure(v)}
        if not figures:
            assert path.stem not in sections
            continue
        section = sections[path.stem]
        assert f"**{tables.machine_name(data.get('machine', {}))}**" in section, path.stem
        assert str(data["date"])[:10] in section, path.stem
        assert f"python benchmarks/{path.stem}.py" in section
        rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \| ([^|]*) \|", section, re.M)
        assert rows, f"{path.stem}: no figures in its table"
        for key, value, verdict in rows:
            assert tables.fmt(data["metrics"][key]) == value.strip(), key
            target = data.get("targets", {}).get(key)
            if target:
                assert verdict.strip().startswith(f"{target['op']} "), key
                met = tables.OPS[target["op"]](data["metrics"][key], target["value"])
                assert verdict.strip().endswith("met" if met else "**missed**"), key
        for key in data.get("targets", {}):
            assert key not in figures or any(key == row[0] for row in rows), f"{path.stem}: target {key} not shown"


def test_a_new_results_file_shows_up_without_a_hand_edit(tmp_path, monkeypatch) -> None:
    tables = generated().results_table()
    (tmp_path / "brand_new.json").write_text(json.dumps({
        "benchmark": "brand_new", "date": "2030-01-02T00:00:00Z", "machine": {"gpu": "NVIDIA H200"},
        "metrics": {"speedup": 2.5, "note": "text is not a figure"}, "targets": {"speedup": {"op": ">=", "value": 3}},
        "checked": True}))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    rendered = tables.markdown()
    assert "## `brand_new`" in rendered and "**H200**, 2030-01-02" in rendered
    assert "| `speedup` | 2.5 | >= 3: **missed** |" in rendered and "note" not in rendered
