"""The speculative-decoding benchmark's quick mode runs end to end, emits the contract's metric names, and its
checks hold (greedy output unchanged by drafts, no block leaked, input-grounded tasks accept drafts)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_quick import run_quick

TASKS = ("extraction", "json_schema", "code_edit", "chat")


def test_speculative_benchmark_quick(smollm_path: Path) -> None:
    lines = run_quick("speculative.py", timeout_s=600)
    assert "checks: greedy_identical True; no leak True; input-grounded tasks accept drafts True" in lines
    result = json.loads(next(line for line in lines.splitlines() if line.startswith("{")))
    metrics = result["metrics"]
    assert metrics["greedy_identical"] is True
    for task in TASKS:
        for batch in result["config"]["batches"]:
            assert metrics[f"speedup_{task}_b{batch}"] > 0
        assert f"acceptance_rate_{task}" in metrics and f"mean_accepted_length_{task}" in metrics
    # Prompt lookup finds the next tokens where the answer quotes the input.
    for task in ("extraction", "code_edit"):
        assert 0 < metrics[f"acceptance_rate_{task}"] <= 1
        assert metrics[f"mean_accepted_length_{task}"] > 1
    assert "targets" not in result  # the contract gives no CPU targets
