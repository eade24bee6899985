"""JSONSchemaBench instances against the compiled grammars: exact, or a clear 400.

For a fixed subset of the MaskBench sample in tests/data/jsonschemabench/ (the
first SUBSET_PER_GROUP schemas of each of its 15 groups, in file order, and the
whole Synthesized group, whose schemas are judged on the values they pin; the
benchmark runs all 770), each schema is compiled in strict mode by the `auto`
choice. Either the compiler refuses it with a 400 that names the keyword and
its path, or every valid instance is accepted and every invalid one rejected.
The sweep runs in a child process (benchmarks/jsonschemabench.py
--per-group), so the grammars it compiles never stay in this one's memory.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SUBSET_PER_GROUP = 4
WHOLE_GROUP = "Synthesized"
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "jsonschemabench.py"
_spec = importlib.util.spec_from_file_location("jsonschemabench_bench", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

CASES = bench.load_cases(per_group=SUBSET_PER_GROUP, whole_groups=(WHOLE_GROUP,))
REFUSAL = re.compile(r"cannot be enforced exactly: keyword '[^']+' at #\S*")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("jsonschemabench") / "cases.json"
    subprocess.run([sys.executable, str(BENCH), "--backends", "auto", "--per-group", str(SUBSET_PER_GROUP),
                    "--whole-group", WHOLE_GROUP, "--cases-json", str(out)],
                   check=True, capture_output=True, text=True, timeout=900)
    return {record["name"]: record for record in json.loads(out.read_text())}


def test_the_subset_covers_every_group_and_both_parts():
    groups = {c["group"] for c in CASES}
    assert len(groups) == 15
    assert len(CASES) == 14 * SUBSET_PER_GROUP + sum(c["group"] == WHOLE_GROUP for c in bench.load_cases())
    assert {c["part"] for c in CASES} == {"tuning", "heldout"}


def test_the_held_out_split_is_fixed():
    cases = bench.load_cases()
    held_out = [c["name"] for c in cases if c["part"] == "heldout"]
    assert len(cases) == 770 and len(held_out) == 254
    assert bench.is_held_out(held_out[0]) and not bench.is_held_out(
        next(c["name"] for c in cases if c["part"] == "tuning"))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_schema_is_enforced_exactly_or_refused(outcomes, case):
    record = outcomes[case["name"]]
    if record["refusal"] is not None:
        assert REFUSAL.search(record["refusal"]), record["refusal"]
        return
    assert record["compiled"] and record["wrong"] == []


def test_synthesized_schemas_are_judged_on_the_values_they_pin(outcomes):
    synthesized = [outcomes[c["name"]] for c in CASES if c["group"] == WHOLE_GROUP]
    assert all(r["valid"] + r["invalid"] >= 1 for r in synthesized)
    assert any(r["invalid"] for r in synthesized) and any(r["valid"] for r in synthesized)
