"""Structured-output benchmark: JSON-schema-constrained vs unconstrained decoding on SmolLM2.

Side by side in one run, on the engine itself (no HTTP): 16 concurrent requests
constrained by JSON schemas, once with jump-forward (grammar-forced tokens
appended without a sampling step) and once step by step, then the same prompts
unconstrained with each request's max_tokens set to what its constrained twin
produced (ignore_eos), so every phase generates exactly the same number of
tokens. The phases rotate in order over the repeats; prefix caching is off so no
phase reuses another's prefill. Every constrained output is parsed and validated
with `jsonschema` (a `length` finish included: the budget closes the JSON)
before any timing counts, the two constrained phases must emit identical tokens,
and the unconstrained lengths are checked.
Throughput is tokens per CPU-second of the benchmark process: the 2-core CPU
is shared with other jobs, and the wall time of identical work swings by tens
of percent from one minute to the next (the wall-clock ratio is reported too).

Also measured: the time of each matcher's mask fill (per request, per token),
the engine's whole grammar step (fill + apply for the batch), and compile time
cold (a new spec) vs cached (the same spec again).

    python benchmarks/structured.py           # full: writes benchmarks/results/structured.json
    python benchmarks/structured.py --quick   # 4 requests, outputs up to 64 tokens, one repeat; writes nothing
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import jsonschema
import torch
from loraplex.engine.config import EngineConfig
from loraplex.engine.host_info import cpu_benchmark_machine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from loraplex.engine.protocol import EngineRequest, SamplingParams
from loraplex.engine.sampler import Sampler
from loraplex.grammar.compiler import GrammarCompilerService
from loraplex.grammar.runtime.matcher import StructuredGrammar, StructuredMatcher
from loraplex.grammar.spec import GrammarKind, GrammarSpec

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "structured.json"

NAME = {"type": "string", "minLength": 1, "maxLength": 30}
SCHEMAS = [
    ("Describe a fictional person.", {
        "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "email": {"type": "string", "format": "email"}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("Create a calendar event for a team meeting.", {
        "type": "object", "properties": {"title": NAME, "date": {"type": "string", "format": "date"},
                                         "attendees": {"type": "array", "minItems": 1, "maxItems": 3, "items": NAME}},
        "required": ["title", "date", "attendees"], "additionalProperties": False}),
    ("Produce an order with two line items.", {
        "type": "object", "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
            "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/line"}}},
        "required": ["order_id", "lines"], "additionalProperties": False,
        "$defs": {"line": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                            "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                           "required": ["sku", "quantity"], "additionalProperties": False}}}),
    ("Report the weather in Oslo.", {
        "type": "object", "properties": {"city": NAME, "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                                         "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60}},
        "required": ["city", "conditions", "temperature_c"], "additionalProperties": False}),
]


class TimedGrammar:
    """Benchmark-only wrapper: its matchers record how long each mask fill takes."""

    def __init__(self, inner: StructuredGrammar, fill_ns: list[int]) -> None:
        self.inner = inner
        self.fill_ns = fill_ns

    def new_matcher(self) -> TimedMatcher:
        return TimedMatcher(self.inner.new_matcher(), self.fill_ns)


class TimedMatcher:
    def __init__(self, inner: StructuredMatcher, fill_ns: list[int]) -> None:
        self.inner = inner
        self.fill_ns = fill_ns

    def accept_token(self, token_id: int) -> bool:
        return self.inner.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        started = time.perf_counter_ns()
        self.inner.fill_bitmask(bitmask, row)
        self.fill_ns.append(time.perf_counter_ns() - started)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def set_token_budget(self, max_tokens: int, phase: int = 0) -> None:
        self.inner.set_token_budget(max_tokens, phase)

    def forced_token_ids(self) -> list[int]:
        return self.inner.forced_token_ids()

    def closed_by_budget(self) -> bool:
        return self.inner.closed_by_budget()


def time_grammar_steps(step_ns: list[int]) -> None:
    """Record the sampler's whole grammar step (batch fill + apply) without changing it."""
    original = Sampler._apply_grammar

    def timed(self, logits, seqs, result):  # type: ignore[no-untyped-def]
        started = time.perf_counter_ns()
        original(self, logits, seqs, result)
        if any(s.matcher is not None for s in seqs):
            step_ns.append(time.perf_counter_ns() - started)

    Sampler._apply_grammar = timed  # type: ignore[method-assign]


def run_phase(engine: LLMEngine, requests: list[EngineRequest], *, jump_forward: bool = False,
              ) -> tuple[float, float, dict[str, tuple[str, str, int, tuple[int, ...]]]]:
    """(wall seconds, CPU seconds of this process, (text, finish, num tokens, token ids) by request id)."""
    engine.config.grammar_jump_forward = jump_forward
    for request in requests:
        engine.add_request(request)
    outputs = {r.request_id: ["", "", 0, ()] for r in requests}
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            for choice in out.choices:
                entry = outputs[out.request_id]
                entry[0] += choice.text
                entry[2] = choice.num_output_tokens
                entry[3] += tuple(choice.token_ids)
                if choice.finish_reason:
                    entry[1] = choice.finish_reason
    return time.perf_counter() - started, time.process_time() - cpu_started, {k: tuple(v) for k, v in outputs.items()}


def prompt_ids(tokenizer, text: str) -> list[int]:
    chat = [{"role": "user", "content": text + " Answer in JSON."}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def measure_compile(compiler: GrammarCompilerService, num_variants: int) -> tuple[list[float], list[float]]:
    cold, cached = [], []
    for variant in range(num_variants):
        for _, schema in SCHEMAS:
            spec = GrammarSpec(GrammarKind.JSON_SCHEMA, {**schema, "title": f"variant {variant}"})  # a new spec
            for sink in (cold, cached):
                started = time.perf_counter()
                compiler.compile_blocking(spec)
                sink.append((time.perf_counter() - started) * 1e3)
    return cold, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    # Quick budgets stay above the shortest valid answer of every schema (~35 tokens for the order).
    num_requests, max_tokens, repeats = (4, 64, 1) if args.quick else (16, 96, 4)
    torch.manual_seed(0)
    model_dir = ensure_default_model(ROOT / "data" / "models")
    engine = LLMEngine.from_model_path(model_dir, EngineConfig(
        max_model_len=1024, kv_cache_bytes=1 << 30, enable_prefix_caching=False, max_num_seqs=64))
    # A KV pool far larger than 16 x (prompt + max_tokens): no phase may be slowed by preemption.
    tokenizer = engine.tokenizer
    compiler = GrammarCompilerService(tokenizer, engine.model_config.vocab_size)
    fill_ns: list[int] = []
    step_ns: list[int] = []
    time_grammar_steps(step_ns)

    cold_ms, cached_ms = measure_compile(compiler, 1 if args.quick else 5)
    cases = [SCHEMAS[i % len(SCHEMAS)] for i in range(num_requests)]
    grammars = [TimedGrammar(compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, s)), fill_ns) for _, s in cases]
    prompts = [prompt_ids(tokenizer, p) for p, _ in cases]

    # Warm-up: one short unconstrained batch so allocator and kernels are hot for both phases.
    run_phase(engine, [EngineRequest(f"warm-{i}", p, SamplingParams(max_tokens=4, temperature=0))
                       for i, p in enumerate(prompts)])

    # Seeded per request (not per repeat): each repeat regenerates the same outputs, so the
    # lengths found by the first constrained run hold for every repeat and either order.
    def constrained(rep: int) -> list[EngineRequest]:
        return [EngineRequest(f"c{rep}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i), grammar=g)
                for i, (p, g) in enumerate(zip(prompts, grammars, strict=True))]

    def unconstrained(rep: int, lengths: list[int]) -> list[EngineRequest]:
        return [EngineRequest(f"u{rep}-{i}", p, SamplingParams(max_tokens=n, temperature=0.7, seed=i, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]

    ratios, jump_ratios, wall_ratios, valid, total, c_tps, j_tps, u_tps = [], [], [], 0, 0, [], [], []
    lengths: list[int] | None = None
    jumped_before = engine.num_jump_forward_tokens_total
    for rep in range(repeats):
        timings: dict[str, tuple[float, float, dict]] = {}
        order = ["step", "jump", "free"]
        order = order[rep % 3:] + order[:rep % 3]  # rotate, so drift in machine load hits every phase
        if lengths is None:
            order = ["step", "jump", "free"]  # the constrained lengths must be known first
        for phase in order:
            if phase == "free":
                assert lengths is not None
                timings[phase] = run_phase(engine, unconstrained(rep, lengths))
            else:
                timings[phase] = run_phase(engine, constrained(rep), jump_forward=phase == "jump")
                lengths = lengths or [n for _, _, n, _ in timings[phase][2].values()]
        s_time, s_cpu, s_out = timings["step"]
        j_time, j_cpu, j_out = timings["jump"]
        u_time, u_cpu, u_out = timings["free"]
        if [v[3] for v in j_out.values()] != [v[3] for v in s_out.values()]:
            raise RuntimeError(f"repeat {rep}: jump-forward and step-by-step emitted different tokens")
        for (text, finish, _, _), (_, schema) in zip(s_out.values(), cases, strict=True):
            total += 1
            if finish in ("stop", "length"):  # a length finish is closed by the budget: it must validate too
                jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
                valid += 1
        for out in (s_out, j_out, u_out):
            if [n for _, _, n, _ in out.values()] != lengths:
                raise RuntimeError(f"repeat {rep}: output lengths differ from the first run; the comparison is void")
        num_tokens = sum(lengths)
        if engine.stats()["num_preemptions"]:
            raise RuntimeError("the engine preempted requests; the phases are not comparable")
        # Tokens per CPU-second of this process: on a CPU shared with other jobs, wall time of
        # identical work swings by tens of percent from minute to minute; CPU time does not.
        c_tps.append(num_tokens / s_cpu)
        j_tps.append(num_tokens / j_cpu)
        u_tps.append(num_tokens / u_cpu)
        ratios.append(c_tps[-1] / u_tps[-1])
        jump_ratios.append(j_tps[-1] / u_tps[-1])
        wall_ratios.append(u_time / j_time)
        print(f"repeat {rep}: {num_tokens} tokens, step-by-step {c_tps[-1]:.2f} tok/cpu-s ({s_time:.0f} s wall), "
              f"jump-forward {j_tps[-1]:.2f} ({j_time:.0f} s), unconstrained {u_tps[-1]:.2f} ({u_time:.0f} s); "
              f"ratios {ratios[-1]:.3f} / {jump_ratios[-1]:.3f} (wall, jump {wall_ratios[-1]:.3f})", flush=True)
    num_jumped = engine.num_jump_forward_tokens_total - jumped_before

    fill_us = [ns / 1e3 for ns in fill_ns]
    step_us = [ns / 1e3 for ns in step_ns]
    metrics = {
        "constrained_over_unconstrained": round(statistics.median(ratios), 4),
        "constrained_over_unconstrained_min": round(min(ratios), 4),
        "constrained_over_unconstrained_max": round(max(ratios), 4),
        "jump_forward_over_unconstrained": round(statistics.median(jump_ratios), 4),
        "jump_forward_over_unconstrained_min": round(min(jump_ratios), 4),
        "jump_forward_over_unconstrained_max": round(max(jump_ratios), 4),
        "jump_forward_over_unconstrained_wall_clock": round(statistics.median(wall_ratios), 4),
        "jump_forward_token_fraction": round(num_jumped / (sum(lengths or [0]) * repeats), 4),
        "constrained_tokens_per_cpu_s": round(statistics.median(c_tps), 2),
        "jump_forward_tokens_per_cpu_s": round(statistics.median(j_tps), 2),
        "unconstrained_tokens_per_cpu_s": round(statistics.median(u_tps), 2),
        "schema_valid_fraction": valid / total,
        "mask_fill_us_p50": round(percentile(fill_us, 50), 2),
        "mask_fill_us_p99": round(percentile(fill_us, 99), 2),
        "grammar_step_us_p50": round(percentile(step_us, 50), 1),   # the sampler's fill + apply, whole batch
        "grammar_step_us_p99": round(percentile(step_us, 99), 1),
        "compile_ms_cold": round(statistics.median(cold_ms), 3),
        "compile_ms_cold_max": round(max(cold_ms), 3),
        "compile_ms_cached": round(statistics.median(cached_ms), 4),
        "num_mask_fills": len(fill_us),
    }
    print(json.dumps(metrics, indent=1))
    if args.quick:
        return
    result = {
        "benchmark": "structured",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": DEFAULT_MODEL_NAME, "dtype": "float32", "device": "cpu", "num_requests": num_requests,
                   "max_tokens": max_tokens, "repeats": repeats, "grammar_backend": "auto", "temperature": 0.7, "prefix_caching": False,
                   "throughput_clock": "process CPU time (wall-clock ratio reported alongside)",
                   "schemas": len(SCHEMAS), "python": platform.python_version()},
        "metrics": metrics,
        "targets": {"constrained_over_unconstrained": {"op": ">=", "value": 0.95},
                    "jump_forward_over_unconstrained": {"op": ">=", "value": 1.3},
                    "schema_valid_fraction": {"op": ">=", "value": 1.0}},
        "checked": True,
    }
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
