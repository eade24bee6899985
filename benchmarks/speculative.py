"""Speculative decoding on the CPU: tokens/s with and without n-gram drafts per task (SmolLM2-135M, float32).

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
is where `auto` is meant to pay (not measured here).

    python benchmarks/speculative.py                 # full run, writes benchmarks/results/speculative.json
    python benchmarks/speculative.py --batches 1 8   # the full run at fewer batch sizes (said in its config)
    python benchmarks/speculative.py --quick         # B in 1, 8, few tokens, same code paths; prints the JSON
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

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

METRIC_NAMES = ["vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"]
TASKS = ("extraction", "json_schema", "code_edit", "chat")
FULL_BATCHES = (1, 8, 64)

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


def run(loaded, mode: str, batch_requests: list[EngineRequest]) -> dict:
    model, config, tokenizer = loaded
    batch = len(batch_requests)
    # KV room for every row at once (a SmolLM2 token's KV is ~46 KB in float32): no preemption in the figures.
    engine = LLMEngine(model, config, EngineConfig(kv_cache_bytes=max(128, 12 * batch) << 20, max_model_len=2048,
                                                   max_num_seqs=max(16, batch), speculative_decoding=mode), tokenizer)
    tokens: dict[str, list[int]] = {}
    clock = Clock()
    for request in batch_requests:
        engine.add_request(request)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            for choice in out.choices:
                tokens.setdefault(out.request_id, []).extend(choice.token_ids)
        steps += 1
    cpu_s, wall_s = clock.read()
    stats = engine.stats()
    generated = sum(len(t) for t in tokens.values())
    bm = engine.block_manager
    return {"tokens": tokens, "generated": generated, "steps": steps, "cpu_s": cpu_s, "wall_s": wall_s,
            "tokens_per_cpu_s": generated / cpu_s, "tokens_per_wall_s": generated / wall_s,
            "draft_tokens": stats["spec_decode_num_draft_tokens_total"],
            "accepted_tokens": stats["spec_decode_num_accepted_tokens_total"],
            "verified_rows": stats["spec_decode_num_verified_rows_total"],
            "blocks_leaked": bm.num_blocks - bm.num_free_blocks}


def case(loaded, compiler: GrammarCompilerService, task: str, batch: int, modes: list[str], max_tokens: int,
         repeats: int) -> dict:
    batch_requests = requests(loaded[2], compiler, task, batch, max_tokens)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:  # interleaved, so load on the shared machine hits every mode alike
            runs[mode].append(run(loaded, mode, batch_requests))
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


def metrics(cases: list[dict], modes: list[str]) -> dict:
    """The contract's flat names: speed-ups per task and batch, acceptance per task (ngram), greedy_identical."""
    out: dict = {}
    for c in cases:
        out[f"speedup_{c['task']}_b{c['batch']}"] = c["ngram"]["speedup_vs_off"]
    for task in TASKS:
        mine = [c["ngram"] for c in cases if c["task"] == task]
        drafts, accepted = sum(m["draft_tokens"] for m in mine), sum(m["accepted_tokens"] for m in mine)
        rows = sum(m["verified_rows"] for m in mine)
        out[f"acceptance_rate_{task}"] = accepted / drafts if drafts else None
        out[f"mean_accepted_length_{task}"] = 1 + accepted / rows if rows else None
    if "auto" in modes:
        for c in cases:
            out[f"speedup_auto_{c['task']}_b{c['batch']}"] = c["auto"]["speedup_vs_off"]
    out["greedy_identical"] = all(c[mode]["identical_to_off"] for c in cases for mode in modes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B in 1, 8, few tokens; prints, writes nothing")
    parser.add_argument("--batches", type=int, nargs="+", help=f"batch sizes (default {list(FULL_BATCHES)}; "
                        "quick: [1, 8])")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the box is shared)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = list(__import__("os").getloadavg())

    from transformers import AutoTokenizer

    path = ensure_default_model(REPO / "data" / "models")
    loaded = (load_model(path, max_model_len=2048), ModelConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    compiler = GrammarCompilerService(loaded[2], loaded[1].vocab_size)
    if args.quick:
        sizes = {"max_tokens": 16, "repeats": 1, "modes": ["off", "ngram"], "batches": args.batches or [1, 8]}
    else:
        sizes = {"max_tokens": 64, "repeats": 2, "modes": ["off", "ngram", "auto"],
                 "batches": args.batches or list(FULL_BATCHES)}
    run(loaded, "ngram", requests(loaded[2], compiler, "extraction", 1, 4))  # warm-up: allocator, kernels
    cases = []
    for task in TASKS:
        for batch in sizes["batches"]:
            result = case(loaded, compiler, task, batch, sizes["modes"], sizes["max_tokens"], sizes["repeats"])
            cases.append(result)
            line = ", ".join(f"{mode} {result[mode]['tokens_per_cpu_s']:.1f} tok/s (x{result[mode]['speedup_vs_off']:.2f}"
                             f", accepted {result[mode]['accepted_tokens']}/{result[mode]['draft_tokens']}"
                             f", identical {result[mode]['identical_to_off']})" for mode in sizes["modes"])
            print(f"{task} batch {batch}: {line}", flush=True)
    compiler.close()
    figures = metrics(cases, sizes["modes"])
    no_leak = all(c[mode]["blocks_leaked"] == 0 for c in cases for mode in sizes["modes"])
    grounded_accepted = all(c["ngram"]["accepted_tokens"] > 0 for c in cases if c["task"] in ("extraction", "code_edit"))
    print(f"checks: greedy_identical {figures['greedy_identical']}; no leak {no_leak}; "
          f"input-grounded tasks accept drafts {grounded_accepted}")
    result = {
        "benchmark": "speculative",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": DEFAULT_MODEL_NAME, "dtype": "float32", "threads": args.threads, "quick": args.quick,
                   "clock": "process CPU time (time.process_time), one intra-op thread; wall times beside it",
                   "load_average_at_start": load_at_start, "speculative_num_tokens": 4, "ngram": [2, 4],
                   "tasks": list(TASKS), **sizes},
        "metrics": figures,
        "metric_names": METRIC_NAMES,
        "cases": cases,
        "checked": figures["greedy_identical"] and no_leak and grounded_accepted,
    }
    if not args.quick and sizes["batches"] != list(FULL_BATCHES):
        result["config"]["note"] = (f"run at batch sizes {sizes['batches']} only, not {list(FULL_BATCHES)}: "
                                    "the full set takes too long on the shared 2-core box")
    if args.quick:
        print(json.dumps(result))
        sys.exit(0 if result["checked"] else 1)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
