"""The benchmarks page's tables, rendered from benchmarks/results/*.json.

One section per results file: what the benchmark measures (its script's docstring), the machine and date
of the recorded run, and one table of its figures with their targets. The docs site renders it at build
time (docs/hooks/generated.py), so a new or rerun benchmark shows up without a hand edit;
`python benchmarks/results_table.py` prints the same Markdown.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# The figures each benchmark is judged by (BENCHMARKS.md), first and in this order; a results file not
# listed here shows its targeted figures, then every other scalar figure.
HEADLINE_KEYS: dict[str, list[str]] = {
    "engine_cpu": ["throughput_ratio_vs_transformers", "batch1_ratio_vs_transformers", "prefix_ttft_speedup",
                   "ours_tokens_per_s", "transformers_tokens_per_s"],
    "api_overhead": ["p50_added_ms_per_request", "p50_added_ms_per_token", "p50_added_ms_per_request_16",
                     "p50_added_ms_per_token_16", "http_over_inprocess_throughput_64", "errors_at_64_streams",
                     "tiny_requests_per_s_1_api_server", "tiny_requests_per_s_2_api_servers"],
    "lora_engine_cpu": ["throughput_ratio_vs_peft", "lora_overhead_ratio"],
    "lora_kernels": ["worst_ratio_to_floor_n_ge_8", "prefill_ratio_to_floor", "cases_beating_all_baselines_fraction"],
    "structured": ["jump_forward_over_unconstrained", "constrained_over_unconstrained", "schema_valid_fraction",
                   "mask_fill_us_p50", "mask_fill_us_p99", "compile_ms_cold", "compile_ms_cached"],
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
    "speculative": ["greedy_identical"] + [f"speedup_{task}_b{b}" for b in (1, 8, 64)
                                           for task in ("extraction", "json_schema", "code_edit", "chat")]
                   + [f"{figure}_{task}" for figure in ("acceptance_rate", "mean_accepted_length")
                      for task in ("extraction", "json_schema", "code_edit", "chat")],
}
OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b,
       ">": lambda a, b: a > b, "<": lambda a, b: a < b}


def machine_name(machine: dict[str, Any]) -> str:
    if machine.get("gpu"):
        return str(machine["gpu"]).replace("NVIDIA ", "")
    cpu = f" ({machine['cpu']})" if machine.get("cpu") else ""
    return f"CPU, {machine.get('cores', '?')} cores{cpu}"


def fmt(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and abs(value) >= 10000:
        return f"{value:,}"
    return str(value)


def is_figure(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def shown_keys(name: str, metrics: dict[str, Any], targets: dict[str, Any]) -> list[str]:
    keys = [k for k in HEADLINE_KEYS.get(name, []) if k in metrics]
    keys += [k for k in targets if k in metrics and k not in keys]
    if name not in HEADLINE_KEYS:
        keys += [k for k, v in metrics.items() if is_figure(v) and k not in keys]
    return keys


def verdict(value: object, target: dict[str, Any] | None) -> str:
    if not target or not (is_figure(value) or isinstance(value, bool)):  # a check (true/false) has a target too
        return ""
    met = OPS[target["op"]](value, target["value"])
    return f"{target['op']} {fmt(target['value'])}: {'met' if met else '**missed**'}"


def method(name: str) -> tuple[str, str]:
    """(one-line summary, the rest) of benchmarks/NAME.py's docstring: how the figures are measured."""
    script = RESULTS.parent / f"{name}.py"
    if not script.exists():
        return "", ""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    summary, _, rest = doc.partition("\n")
    return summary.strip(), rest.strip()


def results() -> list[tuple[str, dict[str, Any]]]:
    """(name, data) of every results file with figures: the benchmarks listed above first, then by name."""
    found = {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}
    order = [n for n in HEADLINE_KEYS if n in found] + sorted(set(found) - set(HEADLINE_KEYS))
    return [(n, found[n]) for n in order if any(is_figure(v) for v in found[n].get("metrics", {}).values())]


def section(name: str, data: dict[str, Any]) -> str:
    metrics, targets = data.get("metrics", {}), data.get("targets", {})
    where = machine_name(data.get("machine", {}))
    per_figure = metrics.get("card_kind_per_figure", {})
    date = str(data.get("date", "undated"))[:10]
    summary, rest = method(name)
    checked = "outputs checked against their reference before timing" if data.get("checked") else \
        "outputs **not** checked before timing"
    lines = [f"## `{name}`", ""]
    if summary:
        lines += [summary, ""]
    lines += [f"Measured on **{where}**, {date}; {checked}. Rerun: `python benchmarks/{name}.py` "
              f"(writes `benchmarks/results/{name}.json`).", ""]
    if rest:
        lines += ['??? note "Method"', "", *[f"    {line}" if line else "" for line in rest.splitlines()], ""]
    lines += ["| metric | value | target | machine |" if per_figure else "| metric | value | target |",
              "|---|---|---|---|" if per_figure else "|---|---|---|"]
    for key in shown_keys(name, metrics, targets):
        value = metrics[key]
        cells = [f"`{key}`", fmt(value), verdict(value, targets.get(key))]
        if per_figure:
            cells.append(str(per_figure.get(key, where)).replace("NVIDIA ", ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown() -> str:
    return "\n".join(section(name, data) for name, data in results())


if __name__ == "__main__":
    print(markdown())
