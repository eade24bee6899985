"""Speculative decoding on the CPU: tokens/s with and without n-gram drafts (SmolLM2-135M, float32).

Two kinds of prompt, each at batch 1 and batch 8, each run with speculation
`off` and `ngram` (and `auto` in the full run), greedy:

- input-grounded: the answer quotes the prompt (copy a paragraph, list items
  again), where prompt lookup finds the next tokens and most drafts are kept;
- open: short creative or factual questions, where it finds little.

Reported per case: generated tokens per CPU second, the speed-up over `off`,
draft tokens proposed and accepted (the engine counters behind Prometheus'
`vllm:spec_decode_num_draft_tokens_total` and
`vllm:spec_decode_num_accepted_tokens_total`), and whether every request's
tokens equal the `off` run's (they must: greedy output is unchanged).

Clock: this process's CPU time (`time.process_time`) with one intra-op thread,
as benchmarks/engine_cpu.py does, because the 2-core box is shared: wall time
there measures the neighbours. Wall times are recorded beside them. On a CPU a
step's cost grows with its tokens, so the gain shrinks as the batch grows; a
GPU's decode is bound by reading the weights until far larger batches, which
is where `auto` is meant to pay (not measured here).

    python benchmarks/speculative.py            # full run, writes benchmarks/results/speculative.json
    python benchmarks/speculative.py --quick    # reduced sizes, same code paths, < 1 minute; prints the JSON
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

METRIC_NAMES = ["vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"]

PASSAGES = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, lit the lamp, and wrote the "
    "weather in his logbook.",
    "Photosynthesis converts light energy into chemical energy: water and carbon dioxide become sugar and oxygen.",
    "A well-tuned database index can turn a full table scan into a handful of page reads, even on large tables.",
    "The recipe calls for two cups of flour, a pinch of salt, three eggs, and a cup of warm milk.",
    "Bees tell each other where flowers are through a dance inside the hive, its angle pointing to the sun.",
    "Compilers translate high-level code into instructions a processor can execute, one pass at a time.",
    "The orchestra tuned to a single A before the conductor raised the baton and the hall went quiet.",
    "Mountains shape the weather: moist air rises, cools, and falls as rain on the windward side.",
]
OPEN_QUESTIONS = [
    "Write a short poem about autumn.",
    "Why is the sky blue?",
    "Give me three ideas for a birthday party.",
    "What makes a good friend?",
    "Describe a city in the future.",
    "How do airplanes fly?",
    "Tell me a fact about octopuses.",
    "What should I cook tonight?",
]


class Clock:
    """CPU seconds of this process (the figure used) and wall seconds (recorded)."""

    def __init__(self) -> None:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()

    def read(self) -> tuple[float, float]:
        return time.process_time() - self.cpu0, time.perf_counter() - self.wall0


def prompts(tokenizer, kind: str, batch: int) -> list[list[int]]:
    if kind == "grounded":
        texts = [f"Copy this text exactly, word for word:\n\n{p}" for p in PASSAGES[:batch]]
    else:
        texts = OPEN_QUESTIONS[:batch]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               return_dict=False)) for t in texts]


def run(loaded, mode: str, batch_prompts: list[list[int]], max_tokens: int) -> dict:
    model, config, tokenizer = loaded
    engine = LLMEngine(model, config, EngineConfig(kv_cache_bytes=128 << 20, max_model_len=2048, max_num_seqs=16,
                                                   speculative_decoding=mode), tokenizer)
    tokens: dict[str, list[int]] = {}
    clock = Clock()
    for i, prompt in enumerate(batch_prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
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
            "blocks_leaked": bm.num_blocks - bm.num_free_blocks}


def case(loaded, kind: str, batch: int, modes: list[str], max_tokens: int, repeats: int) -> dict:
    batch_prompts = prompts(loaded[2], kind, batch)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:  # interleaved, so load on the shared machine hits every mode alike
            runs[mode].append(run(loaded, mode, batch_prompts, max_tokens))
    best = {mode: max(r, key=lambda x: x["tokens_per_cpu_s"]) for mode, r in runs.items()}
    base = best["off"]
    out = {"kind": kind, "batch": batch, "max_tokens": max_tokens}
    for mode, result in best.items():
        entry = {k: v for k, v in result.items() if k != "tokens"}
        entry["speedup_vs_off"] = result["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        entry["acceptance_rate"] = result["accepted_tokens"] / result["draft_tokens"] if result["draft_tokens"] else None
        entry["identical_to_off"] = all(r["tokens"] == base["tokens"] for r in runs[mode])
        out[mode] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="reduced sizes (< 1 minute); prints, writes nothing")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the box is shared)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = list(__import__("os").getloadavg())

    from transformers import AutoTokenizer

    path = ensure_default_model(REPO / "data" / "models")
    loaded = (load_model(path, max_model_len=2048), ModelConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    if args.quick:
        sizes = {"max_tokens": 16, "repeats": 1, "modes": ["off", "ngram"]}
    else:
        sizes = {"max_tokens": 64, "repeats": 2, "modes": ["off", "ngram", "auto"]}
    run(loaded, "ngram", prompts(loaded[2], "grounded", 1), 4)  # warm-up: allocator, kernels
    cases = []
    for kind in ("grounded", "open"):
        for batch in (1, 8):
            result = case(loaded, kind, batch, sizes["modes"], sizes["max_tokens"], sizes["repeats"])
            cases.append(result)
            line = ", ".join(f"{mode} {result[mode]['tokens_per_cpu_s']:.1f} tok/s (x{result[mode]['speedup_vs_off']:.2f}"
                             f", accepted {result[mode]['accepted_tokens']}/{result[mode]['draft_tokens']}"
                             f", identical {result[mode]['identical_to_off']})" for mode in sizes["modes"])
            print(f"{kind} batch {batch}: {line}")
    checked = all(c[mode]["identical_to_off"] and c[mode]["blocks_leaked"] == 0 for c in cases for mode in sizes["modes"])
    grounded_accepted = all(c["ngram"]["accepted_tokens"] > 0 for c in cases if c["kind"] == "grounded")
    print(f"checks: identical and no leak {checked}; grounded prompts accept drafts {grounded_accepted}")
    result = {
        "benchmark": "speculative",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": DEFAULT_MODEL_NAME, "dtype": "float32", "threads": args.threads, "quick": args.quick,
                   "clock": "process CPU time (time.process_time), one intra-op thread; wall times beside it",
                   "load_average_at_start": load_at_start, "speculative_num_tokens": 4, "ngram": [2, 4], **sizes},
        "metric_names": METRIC_NAMES,
        "cases": cases,
        "checked": checked and grounded_accepted,
    }
    if args.quick:
        print(json.dumps(result))
        sys.exit(0 if result["checked"] else 1)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
