"""JSONSchemaBench (MaskBench sample): does each compiled grammar accept exactly its schema's language?

No model is involved. Each schema of the sample (tests/data/jsonschemabench/, 770
real schemas with valid and invalid instances) is compiled for the SmolLM2
tokenizer by xgrammar alone, llguidance alone, and `auto` (the service's own
choice, strict mode); each instance is serialized as our grammars print JSON
(`{"a": 1, "b": [2, 3]}`), tokenized, and fed to a fresh matcher: accepted when
every token is taken and the text is complete (JSON objects are unordered: when
the schema-order text is refused, each object's keys are tried in the order the
grammar takes them; see `judge`). Per backend and per dataset group:
share of schemas compiled, share of valid instances accepted, invalid instances
accepted (a count: the grammar is looser than the schema), coverage (compiled
and every instance judged right), compile time p50/p99 and mask time p50/p99
(one bitmask fill per token of the valid instances). The labels are checked with
`jsonschema` first; an instance whose label `jsonschema` disagrees with is left out.

The sample is split once, before any tuning, into a tuning part and a held-out
part: a schema is held out when the first 8 hex digits of the SHA-256 of its
name, as an integer, are 0, 1 or 2 modulo 10 (`is_held_out`; 254 of the 770).
Coverage work looks only at the tuning part: `--uncovered` and the list of
refusals name tuning schemas alone, and the held-out part is only counted
(`*_heldout` keys, beside `*_tuning` and the keys over all 770).

    python benchmarks/jsonschemabench.py            # all 770: writes benchmarks/results/jsonschemabench.json
    python benchmarks/jsonschemabench.py --quick    # 3 schemas per group; writes nothing
    python benchmarks/jsonschemabench.py --backends auto --uncovered   # also list each uncovered tuning schema
    python benchmarks/jsonschemabench.py --per-group 4 --cases-json out.json   # per-schema outcomes (the tests)
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import referencing.exceptions
import torch
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.host_info import cpu_benchmark_machine
from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from loraplex.grammar.compiler import GrammarCompilerService, GrammarLimits
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "jsonschemabench" / "maskbench_sample.jsonl.gz"
RESULT = ROOT / "benchmarks" / "results" / "jsonschemabench.json"
BACKENDS = ("xgrammar", "llguidance", "auto")
VOCAB = 49152


PARTS = ("tuning", "heldout")


def is_held_out(name: str) -> bool:
    """The fixed split (see the module docstring): 3 in 10 schemas, by a hash of the name alone."""
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest()[:8], 16) % 10 < 3


def load_cases(quick: bool = False, per_group: int | None = None,
               whole_groups: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The sample in file order; `quick` keeps the first 3 schemas of each group, `per_group` the first n (of
    each group but `whole_groups`, kept whole)."""
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        cases = [json.loads(line) for line in f]
    limit = 3 if quick else per_group
    if limit is not None:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for case in cases:
            if seen[case["group"]] < limit or case["group"] in whole_groups:
                seen[case["group"]] += 1
                kept.append(case)
        cases = kept
    for case in cases:
        case["part"] = "heldout" if is_held_out(case["name"]) else "tuning"
    return cases


def _resolve(schema: Any, root: Any, depth: int = 0) -> Any:
    """Follow a local `$ref` (`#/...`), as far as 20 hops."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#") and depth < 20:
        node = root
        for part in schema["$ref"][1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        schema, depth = node, depth + 1
    return schema


def _branches(schema: Any, root: Any) -> list[dict]:
    """The schema and the subschemas its properties may come from (allOf / anyOf / oneOf, resolved)."""
    out, stack = [], [schema]
    while stack and len(out) < 64:
        node = _resolve(stack.pop(0), root)
        if isinstance(node, dict):
            out.append(node)
            for key in ("allOf", "anyOf", "oneOf"):
                stack.extend(node.get(key) or [])
    return out


def in_schema_order(value: Any, schema: Any, root: Any) -> Any:
    """`value` with each object's keys in the order its schema declares them (unknown keys after).

    JSON objects are unordered; our grammars print the declared properties in schema order, then
    the required ones no `properties` declares, then any others, so an instance is compared in that order.
    """
    branches = _branches(schema, root)
    if isinstance(value, list):
        item_schemas = [b["items"] for b in branches if isinstance(b.get("items"), dict)]
        return [in_schema_order(v, item_schemas[0] if item_schemas else None, root) for v in value]
    if not isinstance(value, dict):
        return value
    declared: dict[str, Any] = {}
    for branch in branches:
        for key, sub in (branch.get("properties") or {}).items():
            declared.setdefault(key, sub)
    for branch in branches:  # required keys no `properties` declares come next (as the grammars print them)
        for key in branch.get("required") or []:
            if isinstance(key, str):
                declared.setdefault(key, None)
    extra = next((b["additionalProperties"] for b in branches if isinstance(b.get("additionalProperties"), dict)), None)
    position = {key: i for i, key in enumerate(declared)}
    keys = sorted(value, key=lambda k: (k not in position, position.get(k, 0)))
    return {k: in_schema_order(value[k], declared.get(k) or extra, root) for k in keys}


def enum_instances(case: dict[str, Any]) -> list[tuple[str, bool]]:
    """For a schema without instances that pins a value set (`allOf: [{enum}, ...]`, the Synthesized group):
    every listed value, valid when jsonschema accepts it under draft 7 and 2020-12 alike (the grammars keep a
    value only then). An integral float is printed as the grammars print it (1.0 as 1)."""
    schema = case["schema"]
    members = schema.get("allOf") if isinstance(schema, dict) else None
    values = next((m["enum"] for m in members or [] if isinstance(m, dict) and isinstance(m.get("enum"), list)), [])
    out = []
    for value in values:
        valid = all(cls(schema, format_checker=cls.FORMAT_CHECKER, registry=referencing.Registry()).is_valid(value)
                    for cls in (jsonschema.Draft7Validator, jsonschema.Draft202012Validator))
        printed = int(value) if isinstance(value, float) and value.is_integer() else value
        out.append((json.dumps(printed, ensure_ascii=False), valid))
    return out


def checked_instances(case: dict[str, Any]) -> list[tuple[str, bool]]:
    """(JSON text as our grammars print it, valid) for each instance whose label jsonschema confirms; a schema
    without instances that pins a value set is judged on those values (`enum_instances`)."""
    if not case["tests"]:
        return enum_instances(case)
    validator_class = jsonschema.validators.validator_for(case["schema"], default=jsonschema.Draft202012Validator)
    try:
        # An empty registry: a remote $ref is unresolvable here, never fetched.
        validator = validator_class(case["schema"], format_checker=validator_class.FORMAT_CHECKER,
                                    registry=referencing.Registry())
        tests = [t for t in case["tests"] if validator.is_valid(t["data"]) == t["valid"]]
    except (jsonschema.SchemaError, referencing.exceptions.Unresolvable, RecursionError, ValueError, TypeError):
        tests = case["tests"]
    schema = case["schema"]
    return [(json.dumps(in_schema_order(t["data"], schema, schema), ensure_ascii=False), t["valid"]) for t in tests]


def accepts(grammar: Any, token_ids: list[int], mask_us: list[float] | None) -> bool:
    matcher = grammar.new_matcher()
    row = torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)
    for token in token_ids:
        if mask_us is not None:
            started = time.perf_counter()
            matcher.fill_bitmask(row, 0)
            mask_us.append((time.perf_counter() - started) * 1e6)
        if not matcher.accept_token(token):
            return False
    return matcher.is_completed()


def judge(grammar: Any, text: str, tokenizer: Any, mask_us: list[float] | None) -> bool:
    """Whether the grammar accepts the instance `text`, its objects' keys in whatever order the grammar prints.

    First as `text` is (keys in schema order, and the mask timed); if that is refused, the keys of each
    object are tried in turn, a key kept once its member is accepted (rolled back otherwise): JSON objects
    are unordered, and a grammar's key order (allOf, anyOf and required keys merged) is its own choice.
    """
    if accepts(grammar, tokenizer.encode(text, add_special_tokens=False), mask_us):
        return True
    value = json.loads(text)
    if not _has_object_with_keys(value):
        return False
    matcher = grammar.inner.new_matcher()
    return _feed(matcher, value, tokenizer) is not None and matcher.is_completed()


def _has_object_with_keys(value: Any) -> bool:
    if isinstance(value, dict):
        return len(value) > 1 or any(_has_object_with_keys(v) for v in value.values())
    return isinstance(value, list) and any(_has_object_with_keys(v) for v in value)


def _feed(matcher: Any, value: Any, tokenizer: Any) -> int | None:
    """Feed `value` into `matcher`; the number of tokens accepted, or None (everything rolled back)."""
    if isinstance(value, dict) and value:
        pieces: list[int] = []
        total = _feed_text(matcher, "{", tokenizer)
        if total is None:
            return None
        left = list(value)
        while left:
            fallback = None
            for key in left:
                head = ", " if len(left) < len(value) else ""
                used = _feed_text(matcher, head + json.dumps(key, ensure_ascii=False) + ": ", tokenizer)
                if used is None:
                    continue
                inner = _feed(matcher, value[key], tokenizer)
                if inner is None:
                    matcher.rollback(used)
                    continue
                # Prefer a key after which every other key left can still come (the grammar's order).
                if all(_can_feed(matcher, ", " + json.dumps(other, ensure_ascii=False) + ": ", tokenizer)
                       for other in left if other != key):
                    pieces.append(used + inner)
                    left.remove(key)
                    break
                matcher.rollback(used + inner)
                fallback = fallback or key
            else:
                inner = None if fallback is None else _feed_member(matcher, fallback, value, len(left) < len(value),
                                                                  tokenizer)
                if inner is None:
                    matcher.rollback(total + sum(pieces))
                    return None
                pieces.append(inner)
                left.remove(fallback)
        closing = _feed_text(matcher, "}", tokenizer)
        if closing is None:
            matcher.rollback(total + sum(pieces))
            return None
        return total + sum(pieces) + closing
    if isinstance(value, list) and value:
        total = 0
        for i, item in enumerate(value):
            used = _feed_text(matcher, "[" if i == 0 else ", ", tokenizer)
            inner = None if used is None else _feed(matcher, item, tokenizer)
            if inner is None:
                matcher.rollback(total + (used or 0))
                return None
            total += used + inner
        closing = _feed_text(matcher, "]", tokenizer)
        if closing is None:
            matcher.rollback(total)
            return None
        return total + closing
    return _feed_text(matcher, json.dumps(value, ensure_ascii=False), tokenizer)


def _feed_member(matcher: Any, key: str, value: dict, after_first: bool, tokenizer: Any) -> int | None:
    used = _feed_text(matcher, (", " if after_first else "") + json.dumps(key, ensure_ascii=False) + ": ", tokenizer)
    inner = None if used is None else _feed(matcher, value[key], tokenizer)
    if inner is None:
        matcher.rollback(used or 0)
        return None
    return used + inner


def _can_feed(matcher: Any, text: str, tokenizer: Any) -> bool:
    used = _feed_text(matcher, text, tokenizer)
    if used is None:
        return False
    matcher.rollback(used)
    return True


def _feed_text(matcher: Any, text: str, tokenizer: Any) -> int | None:
    num_accepted = 0
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            matcher.rollback(num_accepted)
            return None
        num_accepted += 1
    return num_accepted


def evaluate(service: GrammarCompilerService, cases: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """One record per schema: whether it compiled (or the refusal), its instances judged, and the times."""
    records = []
    for number, case in enumerate(cases):
        instances = case["instances"]
        record: dict[str, Any] = {"number": number, "name": case["name"], "group": case["group"],
                                  "part": case["part"], "compiled": False, "refusal": None, "wrong": [],
                                  "valid": sum(1 for _, ok in instances if ok),
                                  "invalid": sum(1 for _, ok in instances if not ok),
                                  "valid_accepted": 0, "invalid_accepted": 0, "compile_ms": None, "mask_us": []}
        records.append(record)
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, case["schema"], param="schema", strict=True)
        started = time.perf_counter()
        try:
            grammar = service.compile_blocking(spec)
        except InvalidRequestError as exc:
            record["refusal"] = exc.message
            continue
        record["compile_ms"] = (time.perf_counter() - started) * 1e3
        record["compiled"] = True
        for text, valid in instances:
            ok = judge(grammar, text, tokenizer, record["mask_us"] if valid else None)
            record["valid_accepted" if valid else "invalid_accepted"] += ok
            if ok != valid:
                record["wrong"].append(("valid refused" if valid else "INVALID ACCEPTED", text[:160]))
    return records


def uncovered_lines(records: list[dict[str, Any]]) -> list[str]:
    """Why each uncovered schema of the tuning part is (the held-out part is never listed)."""
    lines = []
    for r in records:
        if r["part"] != "tuning":
            continue
        if r["refusal"] is not None:
            lines.append(f"{r['number']} {r['group']}: refused: {r['refusal'][:240]}")
        lines += [f"{r['number']} {r['group']}: {what}: {text}" for what, text in r["wrong"][:1]]
    return lines


def top_refusals(records: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The commonest refusals of the tuning part."""
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        if r["part"] == "tuning" and r["refusal"] is not None:
            counts[r["refusal"].split(": ", 1)[-1][:60]] += 1
    return sorted(counts.items(), key=lambda kv: -kv[1])[:8]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(name: str, records: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The metrics over all schemas, the same per part (`_tuning`, `_heldout` suffixes), and the group table."""
    metrics = _metrics(name, records)
    for part in PARTS:
        chosen = [r for r in records if r["part"] == part]
        if not chosen:
            continue
        metrics.update({f"{key}_{part}": value for key, value in _metrics(name, chosen).items()
                        if not key.startswith(("compile_ms", "mask_us", "compile_s"))})
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[r["group"]].append(r)
    return metrics, {group: _fractions(_totals(chosen)) for group, chosen in sorted(groups.items())}


def _totals(records: list[dict[str, Any]]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for r in records:
        totals["schemas"] += 1
        if r["compiled"]:  # instance shares are over compiled schemas (a refused schema is a 400, not a miss)
            totals["compiled"] += 1
            for key in ("valid", "invalid", "valid_accepted", "invalid_accepted"):
                totals[key] += r[key]
            totals["covered"] += not r["wrong"]
    return totals


def _metrics(name: str, records: list[dict[str, Any]]) -> dict[str, float]:
    totals = _totals(records)
    overall = _fractions(totals)
    compile_ms = [r["compile_ms"] for r in records if r["compile_ms"] is not None]
    mask_us = [us for r in records for us in r["mask_us"]]
    return {
        f"coverage_{name}": overall["coverage"],
        f"compiled_fraction_{name}": overall["compiled_fraction"],
        f"valid_accepted_fraction_{name}": overall["valid_accepted_fraction"],
        f"invalid_accepted_{name}": int(totals["invalid_accepted"]),
        f"invalid_rejected_fraction_{name}": overall["invalid_rejected_fraction"],
        f"compile_ms_p50_{name}": round(percentile(compile_ms, 50), 3),
        f"compile_ms_p99_{name}": round(percentile(compile_ms, 99), 3),
        f"mask_us_p50_{name}": round(percentile(mask_us, 50), 2),
        f"mask_us_p99_{name}": round(percentile(mask_us, 99), 2),
        f"compile_s_total_{name}": round(sum(compile_ms) / 1e3, 2),
    }


def _fractions(stats: dict[str, float]) -> dict[str, float]:
    def share(a: float, b: float) -> float:
        return round(a / b, 4) if b else 1.0

    return {
        "schemas": int(stats["schemas"]),
        "compiled_fraction": share(stats["compiled"], stats["schemas"]),
        "valid_accepted_fraction": share(stats["valid_accepted"], stats["valid"]),
        "invalid_rejected_fraction": share(stats["invalid"] - stats["invalid_accepted"], stats["invalid"]),
        "invalid_accepted": int(stats["invalid_accepted"]),
        "coverage": share(stats["covered"], stats["schemas"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--compile-timeout-s", type=float, default=10.0)
    parser.add_argument("--merge", action="store_true", help="add to the backends already in the results file")
    parser.add_argument("--uncovered", action="store_true",
                        help="list each uncovered tuning schema (its index) and why; held-out ones are never listed")
    parser.add_argument("--per-group", type=int, help="only the first N schemas of each group; writes no results")
    parser.add_argument("--whole-group", action="append", default=[], help="with --per-group: keep this group whole")
    parser.add_argument("--part", choices=PARTS, help="only this part of the split; writes no results")
    parser.add_argument("--cases-json", type=Path, help="write each schema's outcome here (auto only)")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(ROOT / "data" / "models"))
    cases = load_cases(args.quick, args.per_group, tuple(args.whole_group))
    if args.part:
        cases = [c for c in cases if c["part"] == args.part]
    for case in cases:
        case["instances"] = checked_instances(case)
    metrics: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    for name in args.backends.split(","):
        limits = GrammarLimits(backend=name, compile_timeout_s=args.compile_timeout_s, num_compile_threads=1)
        service = GrammarCompilerService(tokenizer, VOCAB, limits)
        service.compile_blocking(GrammarSpec(GrammarKind.REGEX, "[a-z]"))  # start the compile workers first
        try:
            started = time.perf_counter()
            records = evaluate(service, cases, tokenizer)
            wall = time.perf_counter() - started
        finally:
            service.close()
        backend_metrics, table = summarize(name, records)
        backend_metrics[f"wall_s_{name}"] = round(wall, 1)
        metrics.update(backend_metrics)
        groups[name] = table
        print(f"{name}: {json.dumps(backend_metrics)}\n  top refusals (tuning part): {top_refusals(records)}",
              flush=True)
        if args.uncovered:
            lines = uncovered_lines(records)
            print(f"{name}: {len(lines)} uncovered in the tuning part\n  " + "\n  ".join(lines), flush=True)
        if args.cases_json and name == "auto":
            args.cases_json.write_text(json.dumps([{k: v for k, v in r.items() if k != "mask_us"}
                                                   for r in records]))
    print(json.dumps({"metrics": metrics}, indent=1))
    if args.quick or args.per_group is not None or args.part:
        return
    result = {
        "benchmark": "jsonschemabench",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": cpu_benchmark_machine(),
        "config": {"tokenizer": DEFAULT_MODEL_NAME, "schemas": len(cases), "strict": True,
                   "heldout_schemas": sum(c["part"] == "heldout" for c in cases),
                   "split": "held out: int(sha256(name)[:8], 16) % 10 < 3",
                   "serialization": "json.dumps default separators, ensure_ascii=False",
                   "compile_timeout_s": args.compile_timeout_s, "data": str(DATA.relative_to(ROOT))},
        "metrics": metrics,
        "groups": groups,
        "targets": {"coverage_auto": {"op": ">=", "value": 0.95}, "invalid_accepted_auto": {"op": "==", "value": 0},
                    "coverage_auto_heldout": {"op": ">=", "value": 0.95},
                    "invalid_accepted_auto_heldout": {"op": "==", "value": 0},
                    "compile_ms_p99_auto": {"op": "<=", "value": 100.0}},
        "checked": True,
    }
    if args.merge and RESULT.exists():
        previous = json.loads(RESULT.read_text())
        result["metrics"] = {**previous["metrics"], **metrics}
        result["groups"] = {**previous["groups"], **groups}
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
