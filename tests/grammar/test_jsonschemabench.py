"""JSONSchemaBench instances against the compiled grammars: exact, or a clear 400.

For a fixed subset of the MaskBench sample in tests/data/jsonschemabench/ (the
first SUBSET_PER_GROUP schemas of each of its 15 groups, in file order; the
benchmark runs all 770), each schema is compiled in strict mode by the `auto`
choice. Either the compiler refuses it with a 400 that names the keyword and
its path, or every valid instance is accepted and every invalid one rejected.
Instances are serialized and checked as benchmarks/jsonschemabench.py does
(the same functions).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.spec import GrammarKind, GrammarSpec

SUBSET_PER_GROUP = 4
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "jsonschemabench.py"
_spec = importlib.util.spec_from_file_location("jsonschemabench_bench", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def subset() -> list[dict]:
    taken: dict[str, int] = {}
    cases = []
    for case in bench.load_cases(quick=False):
        if taken.get(case["group"], 0) < SUBSET_PER_GROUP:
            taken[case["group"]] = taken.get(case["group"], 0) + 1
            cases.append(case)
    return cases


CASES = subset()
REFUSAL = re.compile(r"cannot be enforced exactly: keyword '[^']+' at #\S*")


def test_the_subset_covers_every_group():
    assert len({c["group"] for c in CASES}) == 15 and len(CASES) == 15 * SUBSET_PER_GROUP


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_schema_is_enforced_exactly_or_refused(compiler, tokenizer, case):
    param = "response_format.json_schema.schema"
    try:
        grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, case["schema"], param=param,
                                                        strict=True))
    except InvalidRequestError as exc:
        assert exc.param == param
        assert REFUSAL.search(exc.message), exc.message
        return
    wrong = []
    for text, valid in bench.checked_instances(case):
        if bench.judge(grammar, text, tokenizer, None) != valid:
            wrong.append(("valid, rejected" if valid else "INVALID, ACCEPTED", text[:200]))
    assert not wrong, wrong


SYNTHESIZED = [c for c in bench.load_cases(quick=False) if c["group"] == "Synthesized"]


@pytest.mark.parametrize("case", SYNTHESIZED, ids=[c["name"] for c in SYNTHESIZED])
def test_synthesized_schemas_accept_exactly_their_valid_enum_values(compiler, tokenizer, case):
    """This group has no instances: its schemas pin a value set (`allOf: [{enum}, ...]`), so every listed
    value is an instance, labelled by jsonschema (valid under draft 7 and 2020-12 alike, or not)."""
    import jsonschema

    values = next(m["enum"] for m in case["schema"]["allOf"] if "enum" in m)
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, case["schema"], param="p", strict=True))
    for value in values:
        valid = all(cls(case["schema"], format_checker=cls.FORMAT_CHECKER).is_valid(value)
                    for cls in (jsonschema.Draft7Validator, jsonschema.Draft202012Validator))
        # 1.0 and 1 are one JSON number; the grammars print an integral number without a fraction.
        printed = int(value) if isinstance(value, float) and value.is_integer() else value
        text = json.dumps(printed, ensure_ascii=False)
        assert bench.judge(grammar, text, tokenizer, None) == valid, (text, valid)
