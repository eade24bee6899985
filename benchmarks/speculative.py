"""Speculative decoding: tokens/s with and without n-gram drafts per task (SmolLM2-135M), on the CPU or a GPU.

Four tasks, each at batch 1, 8 and 64, each run with speculation `off` and
`ngram` (and `auto` in the full run), greedy:

- extraction: pull named fields out of a given text (input-grounded: the
  answer quotes the prompt, where prompt lookup finds the next tokens);
- json_schema: answer about a given record as JSON under a JSON-schema grammar
  (the engine's response_format path: a compiled grammar on the request);
- code_edit: rewrite a given code snippet with one small change (input-grounded);
- chat: open questions, where prompt lookup finds little.

`metrics` (the names the benchmark contract gives for speculative.json):
`speedup_<task>_b<B>` (tokens per CPU second with `ngram` over `off`, same
run), `speedup_auto_<task>_b<B>` (full run), `acceptance_rate_<task>`
(accepted over proposed draft tokens, all batch sizes, `ngram`),
`mean_accepted_length_<task>` (tokens a row gains per verification: 1 + accepted
drafts per verified row), and `greedy_identical` (every request's tokens equal
the `off` run's in every mode: greedy output must not change). `cases` keeps
the detail: draft tokens proposed and accepted are the engine counters behind
Prometheus' `vllm:spec_decode_num_draft_tokens_total` and
`vllm:spec_decode_num_accepted_tokens_total`.

Clock: this process's CPU time (`time.process_time`) with one intra-op thread,
as benchmarks/engine_cpu.py does, because the 2-core box is shared: wall time
there measures the neighbours. Wall times are recorded beside them. On a CPU a
step's cost grows with its tokens, so the gain shrinks as the batch grows; a
GPU's decode is bound by reading the weights until far larger batches, which
is where `auto` is meant to pay.

`--device cuda` runs the same cases on a GPU with the engine `loraplex serve`
builds there (bfloat16, the CUDA runner with every decode graph captured at
start, the serving defaults: 64 sequences, 512-token steps), one engine per
mode over one copy of the weights, its KV pool sized for the rows (three
engines share the card) and prefix caching off, so every run prefills its
prompts as a fresh request would. Each case runs once per mode untimed first
(Triton compiles for its shapes), then `--repeats` times interleaved (three
times that below batch 64, whose cases last milliseconds); the figure is the
median of wall time between `torch.cuda.synchronize()` calls.
Its figures go into the same file with the suffix `_gpu` (the CPU figures
stay; a CPU run keeps the GPU's), with the card, date and method under `gpu`.
`acceptance_per_position_<task>` is the share of drafts kept at each draft
position (first draft first), from the engine's per-position counters.

    python benchmarks/speculative.py                 # full run, writes benchmarks/results/speculative.json
    python benchmarks/speculative.py --batches 1 8   # the full run at fewer batch sizes (said in its config)
    python benchmarks/speculative.py --quick         # B in 1, 2, few tokens, same code paths; prints the JSON
    python benchmarks/speculative.py --device cuda   # the GPU run (B in 1, 8, 64; off, ngram, auto)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "speculative.json"

from loraplex.engine.config import EngineConfig, ModelConfig  # noqa: E402
from loraplex.engine.host_info import cpu_benchmark_machine  # noqa: E402
from loraplex.engine.llm_engine import LLMEngine  # noqa: E402
from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME, ensure_default_model  # noqa: E402
from loraplex.engine.model.loader import load_model  # noqa: E402
from loraplex.engine.protocol import EngineRequest, SamplingParams  # noqa: E402
from loraplex.grammar.compiler import GrammarCompilerService  # noqa: E402
from loraplex.grammar.spec import GrammarKind, GrammarSpec  # noqa: E402

METRIC_NAMES = ["vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
TASKS = ("extraction", "json_schema", "code_edit", "chat")
FULL_BATCHES = (1, 8, 64)
GPU_TARGET_TASKS = ("extraction", "json_schema", "code_edit")  # the issue's >= 2x at batch 1

# Prompts are built from these lists so that every row of a batch of 64 asks about a different input.
NAMES = ["Alice Moreau", "Bruno Silva", "Chen Wei", "Dana Kowalski", "Emeka Obi", "Freya Lind", "Gustavo Ruiz",
         "Hana Sato"]
CITIES = ["Lisbon", "Toronto", "Osaka", "Nairobi", "Krakow", "Bergen", "Valparaiso", "Adelaide"]
JOBS = ["nurse", "carpenter", "data analyst", "baker", "pilot", "teacher", "architect"]
HOBBIES = ["rock climbing", "chess", "painting", "sailing", "gardening", "baking bread", "birdwatching", "jazz piano"]
VERBS = ["sum", "count", "scale", "filter", "collect", "weigh", "score", "measure"]
NOUNS = ["orders", "samples", "prices", "readings", "votes", "scores", "trips", "items"]
QUESTION_STARTS = ["Tell me a fun fact about", "Why do people like", "Write two sentences about",
                   "What is the history of", "Give me advice about", "Describe", "What would the world be like without",
                   "How would you explain to a child"]
TOPICS = ["octopuses", "autumn", "airplanes", "coffee", "the moon", "bicycles", "music", "rain"]
RECORD_SCHEMA = {"type": "object",
                 "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                                "job": {"type": "string"}},
                 "required": ["name", "age", "city", "job"], "additionalProperties": False}


def person(i: int) -> dict:
    return {"name": NAMES[i % 8], "city": CITIES[(i // 8 + i) % 8], "job": JOBS[i % 7], "age": 23 + (i * 7) % 40,
            "hobby": HOBBIES[(i // 8) % 8]}


def task_text(task: str, i: int) -> str:
    """The i-th row's user message of a task (distinct for i < 64)."""
    p = person(i)
    if task == "extraction":
        text = (f"{p['name']} is {p['age']} years old and works as a {p['job']} in {p['city']}. "
                f"On weekends {p['name'].split()[0]} enjoys {p['hobby']}.")
        return ("Read the text and write its fields one per line as `name: ...`, `age: ...`, `job: ...`, "
                f"`city: ...`, `hobby: ...`.\n\nText: {text}")
    if task == "json_schema":
        return (f"Record: {p['name']}; age {p['age']}; lives in {p['city']}; job: {p['job']}.\n\n"
                "Give this person's name, age, city and job as JSON.")
    if task == "code_edit":
        fn, new = f"{VERBS[i % 8]}_{NOUNS[(i // 8) % 8]}", f"total_{NOUNS[(i // 8) % 8]}_{i}"
        code = (f"def {fn}(values):\n    total = 0\n    for value in values:\n        if value > {i % 10}:\n"
                f"            total += value * {2 + i % 5}\n    return total\n")
        return (f"Rewrite this Python function so that it is named `{new}` instead of `{fn}`. Keep everything "
                f"else the same and reply with the code only.\n\n```python\n{code}```")
    return f"{QUESTION_STARTS[i % 8]} {TOPICS[(i // 8 + i) % 8]}."


class Clock:
    """CPU seconds of this process (the figure used) and wall seconds (recorded)."""

    def __init__(self) -> None:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()

    def read(self) -> tuple[float, float]:
        return time.process_time() - self.cpu0, time.perf_counter() - self.wall0


def requests(tokenizer, compiler: GrammarCompilerService, task: str, batch: int, max_tokens: int
             ) -> list[EngineRequest]:
    # json_schema rows carry a compiled grammar, as a response_format request does after the API compiled it.
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, RECORD_SCHEMA)) \
        if task == "json_schema" else None
    out = []
    for i in range(batch):
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": task_text(task, i)}],
                                                    add_generation_prompt=True, return_dict=False))
        out.append(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                 grammar=grammar))
    return out


def drain(engine: LLMEngine, batch_requests: list[EngineRequest]) -> tuple[dict[str, list[int]], int]:
    """Every request's tokens (by its id up to an `@`) and the steps taken."""
    tokens: dict[str, list[int]] = {}
    for request in batch_requests:
        engine.add_request(request)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            for choice in out.choices:
                tokens.setdefault(out.request_id.split("@")[0], []).extend(choice.token_ids)
        steps += 1
    return tokens, steps


def spec_counters(after: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine's speculation counters (since `before`)."""
    names = {"draft_tokens": "spec_decode_num_draft_tokens_total",
             "accepted_tokens": "spec_decode_num_accepted_tokens_total",
             "verified_rows": "spec_decode_num_verified_rows_total",
             "draft_per_pos": "spec_decode_num_draft_tokens_per_pos",
             "accepted_per_pos": "spec_decode_num_accepted_tokens_per_pos"}
    out = {}
    for name, key in names.items():
        value, earlier = after[key], (before or {}).get(key)
        if isinstance(value, list):
            out[name] = [v - e for v, e in zip(value, earlier, strict=True)] if earlier else list(value)
        else:
            out[name] = value - (earlier or 0)
    return out


def run(loaded, mode: str, batch_requests: list[EngineRequest], num_tokens: int) -> dict:
    model, config, tokenizer = loaded
    batch = len(batch_requests)
    # KV room for every row at once (a SmolLM2 token's KV is ~46 KB in float32): no preemption in the figures.
    engine = LLMEngine(model, config, EngineConfig(kv_cache_bytes=max(128, 12 * batch) << 20, max_model_len=2048,
                                                   max_num_seqs=max(16, batch), speculative_decoding=mode,
                                                   speculative_num_tokens=num_tokens), tokenizer)
    clock = Clock()
    tokens, steps = drain(engine, batch_requests)
    cpu_s, wall_s = clock.read()
    generated = sum(len(t) for t in tokens.values())
    bm = engine.block_manager
    return {"tokens": tokens, "generated": generated, "steps": steps, "cpu_s": cpu_s, "wall_s": wall_s,
            "tokens_per_cpu_s": generated / cpu_s, "tokens_per_wall_s": generated / wall_s,
            **spec_counters(engine.stats()), "blocks_leaked": bm.num_blocks - bm.num_free_blocks}


def case(loaded, compiler: GrammarCompilerService, task: str, batch: int, modes: list[str], max_tokens: int,
         repeats: int, num_tokens: int) -> dict:
    batch_requests = requests(loaded[2], compiler, task, batch, max_tokens)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        # interleaved, each repeat in the other order, so load on the shared machine and a mode's place in the
        # sequence (the allocator's state after the one before) hit every mode alike
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            runs[mode].append(run(loaded, mode, batch_requests, num_tokens))
    best = {mode: max(r, key=lambda x: x["tokens_per_cpu_s"]) for mode, r in runs.items()}
    base = best["off"]
    out = {"task": task, "batch": batch, "max_tokens": max_tokens}
    for mode, result in best.items():
        entry = {k: v for k, v in result.items() if k != "tokens"}
        entry["speedup_vs_off"] = result["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        entry["acceptance_rate"] = result["accepted_tokens"] / result["draft_tokens"] if result["draft_tokens"] else None
        entry["identical_to_off"] = all(r["tokens"] == base["tokens"] for r in runs[mode])
        out[mode] = entry
    return out


def metrics(cases: list[dict], modes: list[str], suffix: str = "") -> dict:
    """The contract's flat names (each ending in `suffix`): speed-ups per task and batch, acceptance per task
    and draft position (ngram), greedy_identical."""
    out: dict = {}
    for c in cases:
        out[f"speedup_{c['task']}_b{c['batch']}{suffix}"] = c["ngram"]["speedup_vs_off"]
    for task in TASKS:
        mine = [c["ngram"] for c in cases if c["task"] == task]
        drafts, accepted = sum(m["draft_tokens"] for m in mine), sum(m["accepted_tokens"] for m in mine)
        rows = sum(m["verified_rows"] for m in mine)
        out[f"acceptance_rate_{task}{suffix}"] = accepted / drafts if drafts else None
        out[f"mean_accepted_length_{task}{suffix}"] = 1 + accepted / rows if rows else None
        out[f"acceptance_per_position_{task}{suffix}"] = per_position(mine)
    if "auto" in modes:
        for c in cases:
            out[f"speedup_auto_{c['task']}_b{c['batch']}{suffix}"] = c["auto"]["speedup_vs_off"]
    out[f"greedy_identical{suffix}"] = all(c[mode]["identical_to_off"] for c in cases for mode in modes)
    return out


def per_position(runs: list[dict]) -> list[float | None]:
    """Accepted over verified drafts at each draft position, summed over `runs`."""
    drafted = [sum(col) for col in zip(*(r["draft_per_pos"] for r in runs), strict=True)]
    accepted = [sum(col) for col in zip(*(r["accepted_per_pos"] for r in runs), strict=True)]
    return [a / d if d else None for a, d in zip(accepted, drafted, strict=True)]


# ---- on a GPU -------------------------------------------------------------------------------------------
GPU_KV_TOKENS_PER_SEQ = 1024  # KV room per row: a prompt (under 200 tokens), its answer and drafts


def gpu_engine_config(mode: str, max_num_seqs: int, num_tokens: int, dtype: str = "bfloat16") -> EngineConfig:
    """`loraplex serve`'s engine for device=cuda (platform/wiring.py over the Settings defaults) but for the KV
    pool, sized for the rows rather than 0.9 of the card (an engine per mode shares it), and prefix caching, off
    so that every run prefills its prompts as fresh requests do."""
    return EngineConfig(block_size=16, num_blocks=max_num_seqs * GPU_KV_TOKENS_PER_SEQ // 16,
                        max_num_batched_tokens=512, max_num_seqs=max_num_seqs, max_model_len=2048,
                        dtype=dtype, device="cuda", enable_prefix_caching=False, speculative_decoding=mode,
                        speculative_num_tokens=num_tokens)


def gpu_engines(loaded, modes: list[str], max_num_seqs: int, num_tokens: int, dtype: str = "bfloat16"
                ) -> dict[str, LLMEngine]:
    model, config, tokenizer = loaded
    engines = {}
    for mode in modes:
        # As the engine-core process: no text (the API servers make it), every decode graph and every mixed-step
        # graph (verification steps' too, where the mode drafts) captured at start.
        engine = LLMEngine(model, config, gpu_engine_config(mode, max_num_seqs, num_tokens, dtype), tokenizer,
                           detokenize=False)
        engine.runner.capture_decode_graphs()
        engine.runner.capture_mixed_graphs()
        engines[mode] = engine
    return engines


def gpu_run(engine: LLMEngine, batch_requests: list[EngineRequest], tag: str) -> dict:
    """One run of fresh copies of `batch_requests` (ids tagged, so a warm engine takes them again), timed by
    wall clock between synchronizations; counters are this run's."""
    fresh = [dataclasses.replace(r, request_id=f"{r.request_id}@{tag}", arrival_time=time.monotonic())
             for r in batch_requests]
    runner, before = engine.runner, engine.stats()
    graph_steps, eager_steps, mixed_steps = runner.num_graph_steps, runner.num_eager_steps, runner.num_mixed_graph_steps
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens, steps = drain(engine, fresh)
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    bm = engine.block_manager
    return {"tokens": tokens, "generated": generated, "steps": steps, "wall_s": wall_s,
            "tokens_per_s": generated / wall_s, "graph_steps": runner.num_graph_steps - graph_steps,
            "eager_steps": runner.num_eager_steps - eager_steps,
            "mixed_graph_steps": runner.num_mixed_graph_steps - mixed_steps, **spec_counters(engine.stats(), before),
            "blocks_leaked": bm.num_blocks - bm.num_free_blocks}


def gpu_case(engines: dict[str, LLMEngine], compiler: GrammarCompilerService, tokenizer, task: str, batch: int,
             max_tokens: int, repeats: int) -> dict:
    batch_requests = requests(tokenizer, compiler, task, batch, max_tokens)
    for engine in engines.values():
        gpu_run(engine, batch_requests, "warm-up")  # Triton compiles for this case's shapes, untimed
    runs: dict[str, list[dict]] = {mode: [] for mode in engines}
    for i in range(repeats):
        for mode, engine in engines.items():  # interleaved: a drift of the clock hits every mode alike
            runs[mode].append(gpu_run(engine, batch_requests, str(i)))
    return summarize(task, batch, max_tokens, runs)


def summarize(task: str, batch: int, max_tokens: int, runs: dict[str, list[dict]]) -> dict:
    """Per mode its median run (by tokens/s) with the spread, and the speed-up of medians over `off`."""
    median = {mode: sorted(r, key=lambda x: x["tokens_per_s"])[(len(r) - 1) // 2] for mode, r in runs.items()}
    reference = runs["off"][0]["tokens"]
    out: dict[str, Any] = {"task": task, "batch": batch, "max_tokens": max_tokens}
    for mode, result in median.items():
        rates = [r["tokens_per_s"] for r in runs[mode]]
        entry = {k: v for k, v in result.items() if k != "tokens"}
        entry |= {"tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates),
                  "speedup_vs_off": result["tokens_per_s"] / median["off"]["tokens_per_s"],
                  "acceptance_rate": result["accepted_tokens"] / result["draft_tokens"] if result["draft_tokens"]
                  else None,
                  "identical_to_off": all(r["tokens"] == reference for r in runs[mode]),
                  "requests_differing_from_off": max(sum(r["tokens"][rid] != t for rid, t in reference.items())
                                                     for r in runs[mode])}
        out[mode] = entry
    return out


def gpu_repeats(repeats: int, batch: int) -> int:
    """Timed runs of a GPU case: a case of a few sequences lasts 8-30 ms, where one stray host hiccup moved a
    median of three by 5-10% between runs of the same code, so small batches run three times as often."""
    return repeats * 3 if batch < 64 else repeats


def gpu_targets(batches: list[int]) -> dict[str, dict]:
    """The issue's targets on a GPU: 2x at batch 1 where the answer quotes its input, no loss at batch 64."""
    targets = {f"speedup_{task}_b1_gpu": {"op": ">=", "value": 2.0} for task in GPU_TARGET_TASKS if 1 in batches}
    targets |= {f"speedup_{task}_b64_gpu": {"op": ">=", "value": 1.0} for task in TASKS if 64 in batches}
    return targets | {"greedy_identical_gpu": {"op": "==", "value": True}}


def gpu_machine() -> dict[str, Any]:
    import triton

    return {**cpu_benchmark_machine(), "gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
            "triton": triton.__version__}


def merged_results(own: dict[str, Any], gpu: bool) -> dict[str, Any]:
    """`own` (one device's part) over the file as it stands: the other device's figures, targets and section
    stay. The GPU part is its `_gpu` metrics, `targets` and the `gpu` section; the rest is the CPU's."""
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if gpu:
        kept = {k: v for k, v in old.get("metrics", {}).items() if not k.endswith("_gpu")}
        return {**old, "benchmark": "speculative", "metrics": kept | own["metrics"], "targets": own["targets"],
                "gpu": own["gpu"]}
    kept = {k: v for k, v in old.get("metrics", {}).items() if k.endswith("_gpu")}
    extra = {key: old[key] for key in ("targets", "gpu") if key in old}
    return {**own, "metrics": own["metrics"] | kept, **extra}


def run_gpu(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    started = time.perf_counter()
    path = ensure_default_model(REPO / "data" / "models")
    model_config = ModelConfig.from_pretrained(path)
    loaded = (load_model(path, 2048, torch.bfloat16, "cuda"), model_config, AutoTokenizer.from_pretrained(path))
    compiler = GrammarCompilerService(loaded[2], model_config.vocab_size)
    engines = gpu_engines(loaded, sizes["modes"], max(64, *sizes["batches"]), sizes["speculative_num_tokens"])
    cases = []
    for task in args.tasks:
        for batch in sizes["batches"]:
            result = gpu_case(engines, compiler, loaded[2], task, batch, sizes["max_tokens"],
                              gpu_repeats(sizes["repeats"], batch))
            cases.append(result)
            print(f"{task} batch {batch}: {case_line(result, sizes['modes'], 'tokens_per_s')} "
                  f"[{time.perf_counter() - started:.0f} s]", flush=True)
    overlap = {mode: engine.overlap is not None for mode, engine in engines.items()}
    for engine in engines.values():
        engine.close()
    identity = float32_identity(path, model_config, loaded[2], compiler, args.tasks, sizes)
    compiler.close()
    figures = metrics(cases, sizes["modes"], "_gpu")
    # bfloat16 sums depend on the step's shape (a verification row is not a decode row), so a near-tie can go
    # the other way with drafts: the identity check is float32's; bfloat16's share of identical requests beside.
    drafting = [(c, mode) for c in cases for mode in sizes["modes"] if mode != "off"]
    differing = sum(c[mode]["requests_differing_from_off"] for c, mode in drafting)
    figures["greedy_identical_share_bf16_gpu"] = 1 - differing / sum(c["batch"] for c, _ in drafting)
    figures["greedy_identical_gpu"] = identity["identical"]
    checked = report_checks(cases, sizes["modes"], figures["greedy_identical_gpu"])
    config = {"model": DEFAULT_MODEL_NAME, "dtype": "bfloat16", "quick": args.quick, **sizes,
              "clock": "wall time between torch.cuda.synchronize() calls; median of the repeats (three times "
                       "`repeats` below batch 64), min and max beside",
              "engine": "the CUDA runner as loraplex serve builds it: decode CUDA graphs captured at start, 64 "
                        "sequences, 512-token steps; one engine per mode over one copy of the weights; KV pool "
                        f"{GPU_KV_TOKENS_PER_SEQ} tokens a row; prefix caching off (each run prefills); "
                        "overlapped scheduling as the GPU's default (steps without drafts launch ahead)",
              "overlap_scheduling": overlap,
              "warm_up": "each case once per mode, untimed, before its timed runs",
              "ngram": [2, 4], "tasks": list(TASKS),
              "seconds_total": round(time.perf_counter() - started, 1)}
    section = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": gpu_machine(),
               "config": config, "cases": cases, "float32_identity": identity, "checked": checked}
    return {"metrics": figures, "targets": gpu_targets(sizes["batches"]), "gpu": section}


def case_line(result: dict, modes: list[str], rate: str) -> str:
    return ", ".join(f"{mode} {result[mode][rate]:.1f} tok/s (x{result[mode]['speedup_vs_off']:.2f}"
                     f", accepted {result[mode]['accepted_tokens']}/{result[mode]['draft_tokens']}"
                     f", identical {result[mode]['identical_to_off']})" for mode in modes)


def float32_identity(path: Path, model_config: ModelConfig, tokenizer, compiler: GrammarCompilerService,
                     tasks: list[str], sizes: dict[str, Any]) -> dict[str, Any]:
    """Every case once more in float32, untimed, `off` against each drafting mode: are the greedy tokens the
    same request for request?"""
    model = load_model(path, 2048, torch.float32, "cuda")
    engines = gpu_engines((model, model_config, tokenizer), sizes["modes"], max(64, *sizes["batches"]),
                          sizes["speculative_num_tokens"], "float32")
    differing: dict[str, int] = {}
    for task in tasks:
        for batch in sizes["batches"]:
            batch_requests = requests(tokenizer, compiler, task, batch, sizes["max_tokens"])
            outputs = {mode: drain(engine, [dataclasses.replace(r, request_id=f"{r.request_id}@f32")
                                            for r in batch_requests])[0] for mode, engine in engines.items()}
            for mode in sizes["modes"]:
                if mode != "off":
                    differing[f"{task}_b{batch}_{mode}"] = sum(
                        outputs[mode][rid] != tokens for rid, tokens in outputs["off"].items())
    for engine in engines.values():
        engine.close()
    print(f"float32 identity: {sum(differing.values())} requests differ", flush=True)
    return {"identical": not any(differing.values()), "requests_differing": differing}


def report_checks(cases: list[dict], modes: list[str], identical: bool) -> bool:
    no_leak = all(c[mode]["blocks_leaked"] == 0 for c in cases for mode in modes)
    grounded_accepted = all(c["ngram"]["accepted_tokens"] > 0 for c in cases if c["task"] in ("extraction", "code_edit"))
    print(f"checks: greedy_identical {identical}; no leak {no_leak}; "
          f"input-grounded tasks accept drafts {grounded_accepted}", flush=True)
    return identical and no_leak and grounded_accepted


def run_cpu(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    load_at_start = list(__import__("os").getloadavg())
    path = ensure_default_model(REPO / "data" / "models")
    loaded = (load_model(path, max_model_len=2048), ModelConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    compiler = GrammarCompilerService(loaded[2], loaded[1].vocab_size)
    # warm-up: allocator, kernels
    run(loaded, "ngram", requests(loaded[2], compiler, "extraction", 1, 4), sizes["speculative_num_tokens"])
    cases = []
    for task in TASKS:
        for batch in sizes["batches"]:
            result = case(loaded, compiler, task, batch, sizes["modes"], sizes["max_tokens"], sizes["repeats"],
                          sizes["speculative_num_tokens"])
            cases.append(result)
            print(f"{task} batch {batch}: {case_line(result, sizes['modes'], 'tokens_per_cpu_s')}", flush=True)
    compiler.close()
    figures = metrics(cases, sizes["modes"])
    checked = report_checks(cases, sizes["modes"], figures["greedy_identical"])
    result = {
        "benchmark": "speculative",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": DEFAULT_MODEL_NAME, "dtype": "float32", "threads": args.threads, "quick": args.quick,
                   "clock": "process CPU time (time.process_time), one intra-op thread; wall times beside it",
                   "load_average_at_start": load_at_start, "ngram": [2, 4],
                   "tasks": list(TASKS), **sizes},
        "metrics": figures,
        "metric_names": METRIC_NAMES,
        "cases": cases,
        "checked": checked,
    }
    if not args.quick and sizes["batches"] != list(FULL_BATCHES):
        result["config"]["note"] = (f"run at batch sizes {sizes['batches']} only, not {list(FULL_BATCHES)}: "
                                    "the full set takes too long on the shared 2-core box")
    return result


def run_sizes(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        sizes = {"max_tokens": 16, "repeats": 1, "modes": ["off", "ngram"], "batches": args.batches or [1, 2]}
    elif args.device == "cuda":
        sizes = {"max_tokens": 128, "repeats": 3, "modes": ["off", "ngram", "auto"],
                 "batches": args.batches or list(FULL_BATCHES)}
    else:
        sizes = {"max_tokens": 64, "repeats": 3, "modes": ["off", "ngram", "auto"],
                 "batches": args.batches or list(FULL_BATCHES)}
    sizes["speculative_num_tokens"] = args.num_tokens or EngineConfig().speculative_num_tokens  # the server's default
    return sizes | {k: v for k, v in (("max_tokens", args.max_tokens), ("repeats", args.repeats)) if v is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B in 1, 2, few tokens; prints, writes nothing")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", help=f"batch sizes (default {list(FULL_BATCHES)}; "
                        "quick: [1, 2])")
    parser.add_argument("--max-tokens", type=int, help="tokens per request (default: CPU 64, GPU 128, quick 16)")
    parser.add_argument("--repeats", type=int, help="timed runs per mode (default: CPU 3 (best), GPU 3 (median))")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="GPU: the tasks to run")
    parser.add_argument("--num-tokens", type=int, help="draft tokens per sequence and step (default: the server's "
                        "speculative_num_tokens)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the box is shared)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: nothing measured (run --device cuda on a machine with one)")
        return
    sizes = run_sizes(args)
    result = run_gpu(args, sizes) if args.device == "cuda" else run_cpu(args, sizes)
    checked = result["gpu"]["checked"] if args.device == "cuda" else result["checked"]
    if args.quick:
        print(json.dumps(result))
        sys.exit(0 if checked else 1)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(merged_results(result, gpu=args.device == "cuda"), indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
