"""Render the README's benchmark table from benchmarks/results/*.json.

`python benchmarks/readme_table.py` prints the table; `--write` replaces the
block between the markers in README.md, so the README never drifts from the
recorded results (tests/test_readme_benchmarks.py checks that it has not).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"

# The figures each issue asks for (BENCHMARKS.md), in the order the README shows them.
HEADLINE_KEYS: dict[str, list[str]] = {
    "engine_cpu": ["throughput_ratio_vs_transformers", "batch1_ratio_vs_transformers", "prefix_ttft_speedup",
                   "ours_tokens_per_s", "transformers_tokens_per_s"],
    "api_overhead": ["p50_added_ms_per_request", "p50_added_ms_per_token", "p50_added_ms_per_request_16",
                     "p50_added_ms_per_token_16", "http_over_inprocess_throughput_64", "errors_at_64_streams",
                     "tiny_requests_per_s_1_api_server", "tiny_requests_per_s_2_api_servers"],
    "lora_engine_cpu": ["throughput_ratio_vs_peft", "lora_overhead_ratio"],
    "lora_kernels": ["worst_ratio_to_floor_n_ge_8", "prefill_ratio_to_floor", "cases_beating_all_baselines_fraction"],
    "structured": ["jump_forward_over_unconstrained", "constrained_over_unconstrained", "schema_valid_fraction", "mask_fill_us_p50",
                   "mask_fill_us_p99", "compile_ms_cold", "compile_ms_cached"],
    "sessions": ["pinned_ttft_speedup", "host_restore_ttft_speedup"],
    "billing": ["metering_overhead_ms_p50", "metering_overhead_ms_p99", "ledger_writes_per_s_postgres"],
    "gpu_engine": ["decode_b1_fraction_of_roofline", "decode_b64_fraction_of_roofline",
                   "throughput_ratio_vs_transformers", "lora_8_adapters_step_ratio", "attention_bw_fraction"],
    "attention_kernels": ["attention_bw_fraction"],
    "gpu_tp": ["tp4_70b_decode_b1_fraction_of_roofline", "tp4_70b_decode_b64_fraction_of_roofline",
               "tp2_over_tp1_8b_b1_step", "tp4_lora_8_adapters_step_ratio"],
    "jsonschemabench": ["coverage_auto", "invalid_accepted_auto", "valid_accepted_fraction_auto",
                        "compile_ms_p99_auto", "mask_us_p99_auto", "coverage_llguidance", "coverage_xgrammar",
                        "invalid_accepted_xgrammar"],
    "noisy_neighbor": ["victim_p95_ratio_worst", "victim_p95_ratio_stop_strings", "victim_p95_ratio_big_body",
                       "victim_p95_ratio_upload_bomb", "victim_p95_ratio_prompt_list", "victim_p95_ratio_many_tools",
                       "victim_p95_ratio_deep_schema", "victim_p95_ratio_logit_bias"],
    "responses": ["turn10_ttft_speedup_vs_stateless", "turn10_ttft_speedup_vs_prefix_cached",
                  "turn10_ttft_speedup_vs_prefix_cached_quiet"],
}
OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b,
       ">": lambda a, b: a > b, "<": lambda a, b: a < b}


def machine_name(machine: dict) -> str:
    if machine.get("gpu"):
        return str(machine["gpu"]).replace("NVIDIA ", "")
    return f"CPU, {machine.get('cores', '?')} cores"


def fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def rows() -> list[str]:
    out = []
    for name, keys in HEADLINE_KEYS.items():
        path = RESULTS / f"{name}.json"
        if not path.exists():
            out.append(f"| `{name}` | (not yet recorded) | | | |")
            continue
        data = json.loads(path.read_text())
        metrics, targets = data.get("metrics", {}), data.get("targets", {})
        where = machine_name(data.get("machine", {}))
        for key in keys:
            if key not in metrics:
                continue
            value, target = metrics[key], targets.get(key)
            if target:
                met = OPS[target["op"]](value, target["value"])
                verdict = f"{target['op']} {fmt(target['value'])}: {'met' if met else '**missed**'}"
            else:
                verdict = ""
            # A file can hold figures from several machines (e.g. TP2 on 2 GPUs beside TP4 on 4): each names its own.
            card = metrics.get("card_kind_per_figure", {}).get(key)
            figure_where = card.replace("NVIDIA ", "") if card else where
            out.append(f"| `{name}` | `{key}` | {fmt(value)} | {verdict} | {figure_where} |")
    return out


def table() -> str:
    head = ["| benchmark | metric | value | target | machine |", "|---|---|---|---|---|"]
    return "\n".join([START, *head, *rows(), END])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the table block in README.md")
    args = parser.parse_args()
    rendered = table()
    if not args.write:
        print(rendered)
        return 0
    text = README.read_text()
    if START not in text or END not in text:
        print("README.md has no benchmark markers", file=sys.stderr)
        return 1
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    README.write_text(before + rendered + after)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
