"""Engine on the CPU: our paged engine against transformers on SmolLM2-135M, float32.

Three figures, each measured side by side in one run on the same machine,
each after checking the outputs it times:

1. Throughput: 32 requests (prompts 20-400 tokens, outputs 16-256, fixed seed), greedy.
   Ours: all submitted at once (continuous batching). Transformers: `generate` in static
   left-padded batches of 8, each batch running to its longest output. Both count only
   each request's own tokens. Checked: every request's greedy tokens equal transformers'
   (see `check_equal`: exact, or the first difference is a float near-tie, reported).
2. Batch-1 decode tokens/s against a transformers loop with its KV cache (prefill not timed).
3. TTFT of a request whose 1,000-token prefix is cached, against the same request uncached.

Clock: both sides run with one intra-op thread and are timed by this process's CPU time
(`time.process_time`), because the 2-core box is shared by many jobs: wall time there
measures the neighbours. Wall times are recorded beside them.

    python benchmarks/engine_cpu.py            # full run, writes benchmarks/results/engine_cpu.json
    python benchmarks/engine_cpu.py --quick    # reduced sizes, same code paths, < 1 minute
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "engine_cpu.json"

from loraplex.engine.config import EngineConfig, ModelConfig  # noqa: E402
from loraplex.engine.host_info import cpu_benchmark_machine  # noqa: E402
from loraplex.engine.llm_engine import LLMEngine  # noqa: E402
from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME, ensure_default_model  # noqa: E402
from loraplex.engine.model.loader import load_model  # noqa: E402
from loraplex.engine.protocol import EngineRequest, SamplingParams  # noqa: E402

SENTENCES = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk.",
    "Photosynthesis converts light energy into chemical energy stored in sugars.",
    "In 1492, a small fleet set out across the Atlantic in search of a westward route.",
    "A well-tuned database index can turn a full table scan into a handful of page reads.",
    "The recipe calls for two cups of flour, a pinch of salt, and three eggs.",
    "Mountains shape the weather: moist air rises, cools, and falls as rain on one side.",
    "She wrote the letter twice, then decided to deliver it in person instead.",
    "Compilers translate high-level code into instructions a processor can execute.",
    "The orchestra tuned to a single A before the conductor raised the baton.",
    "Bees communicate the direction of flowers through a dance inside the hive.",
]


class Clock:
    """CPU seconds of this process (the figure used) and wall seconds (recorded)."""

    def __init__(self) -> None:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()

    def read(self) -> tuple[float, float]:
        return time.process_time() - self.cpu0, time.perf_counter() - self.wall0


def make_prompt(tokenizer, length: int, rng: random.Random) -> list[int]:
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(" " + rng.choice(SENTENCES))
    return ids[:length]


def ours_engine(loaded, **overrides) -> LLMEngine:
    model, config, tokenizer = loaded
    settings = {"kv_cache_bytes": 1 << 30, "max_model_len": 2048, "max_num_seqs": 64,
                "max_num_batched_tokens": 512} | overrides
    return LLMEngine(model, config, EngineConfig(**settings), tokenizer)


def run_ours(engine: LLMEngine, requests: list[EngineRequest]) -> tuple[dict[str, list[int]], tuple[float, float]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    clock = Clock()
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for choice in out.choices:
                tokens[out.request_id] += choice.token_ids
    return tokens, clock.read()


@torch.inference_mode()
def run_hf_static(hf, prompts: list[list[int]], outputs: list[int], batch: int
                  ) -> tuple[list[list[int]], tuple[float, float]]:
    results: list[list[int]] = []
    clock = Clock()
    for i in range(0, len(prompts), batch):
        group, lengths = prompts[i : i + batch], outputs[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lengths), do_sample=False)
        results += [out[j, width : width + lengths[j]].tolist() for j in range(len(group))]
    return results, clock.read()


def check_equal(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Count requests whose greedy tokens are identical; report where the others first differ."""
    exact = sum(a == b for a, b in zip(ours, theirs, strict=True))
    first_diff = [next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                  for a, b in zip(ours, theirs, strict=True) if a != b]
    return {"requests": len(ours), "identical": exact, "first_difference_at": first_diff}


def throughput(loaded, hf, num: int, prompt_range, output_range, seed: int) -> dict:
    tokenizer = loaded[2]
    rng = random.Random(seed)
    prompts = [make_prompt(tokenizer, rng.randint(*prompt_range), rng) for _ in range(num)]
    outputs = [rng.randint(*output_range) for _ in range(num)]
    requests = [EngineRequest(f"t{i}", p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
                for i, (p, m) in enumerate(zip(prompts, outputs, strict=True))]
    ours_tokens, (ours_s, ours_wall) = run_ours(ours_engine(loaded), requests)
    ours_list = [ours_tokens[f"t{i}"] for i in range(num)]
    hf_list, (hf_s, hf_wall) = run_hf_static(hf, prompts, outputs, batch=8)
    check = check_equal(ours_list, hf_list)
    generated = sum(outputs)
    total = generated + sum(len(p) for p in prompts)
    return {
        "ours_cpu_s": ours_s, "transformers_cpu_s": hf_s, "ours_wall_s": ours_wall, "transformers_wall_s": hf_wall,
        "wall_ratio": hf_wall / ours_wall, "generated_tokens": generated, "total_tokens": total,
        "ours_tokens_per_s": total / ours_s, "transformers_tokens_per_s": total / hf_s,
        "ours_generated_tokens_per_s": generated / ours_s, "transformers_generated_tokens_per_s": generated / hf_s,
        "ratio": hf_s / ours_s, "check": check,
    }


@torch.inference_mode()
def hf_decode_loop(hf, prompt: list[int], steps: int) -> tuple[list[int], float]:
    from transformers import DynamicCache

    cache = DynamicCache()
    out = hf(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    token = int(out.logits[0, -1].argmax())
    tokens = [token]
    clock = Clock()
    for _ in range(steps - 1):
        out = hf(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
    return tokens, clock.read()[0]


def ours_decode(loaded, prompt: list[int], steps: int) -> tuple[list[int], float]:
    engine = ours_engine(loaded, kv_cache_bytes=64 << 20)
    engine.add_request(EngineRequest("b1", prompt, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)))
    tokens: list[int] = []
    for out in engine.step():  # prefill + first token: not timed, as for transformers
        tokens += out.choices[0].token_ids
    clock = Clock()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.choices[0].token_ids
    return tokens, clock.read()[0]


def batch1(loaded, hf, steps: int, repeats: int) -> dict:
    prompt = make_prompt(loaded[2], 100, random.Random(1))
    ours_times, hf_times = [], []
    ours_tokens = hf_tokens = None
    for _ in range(repeats):  # interleaved, so load on the shared machine hits both alike
        ours_tokens, t = ours_decode(loaded, prompt, steps)
        ours_times.append(t)
        hf_tokens, t = hf_decode_loop(hf, prompt, steps)
        hf_times.append(t)
    decoded = steps - 1
    ours_tps = decoded / statistics.median(ours_times)
    hf_tps = decoded / statistics.median(hf_times)
    return {"ours_tokens_per_s": ours_tps, "transformers_tokens_per_s": hf_tps, "ratio": ours_tps / hf_tps,
            "ours_s": ours_times, "transformers_s": hf_times, "tokens_equal": ours_tokens == hf_tokens}


def ttft(engine: LLMEngine, request: EngineRequest) -> tuple[int, float]:
    clock = Clock()
    engine.add_request(request)
    while True:
        for out in engine.step():
            if out.choices and out.choices[0].token_ids:
                elapsed = clock.read()[0]
                engine.abort(request.request_id)
                return out.choices[0].token_ids[0], elapsed


def prefix_reuse(loaded, prefix_len: int, repeats: int) -> dict:
    tokenizer = loaded[2]
    rng = random.Random(2)
    prefix = make_prompt(tokenizer, prefix_len, rng)
    budget = {"max_num_batched_tokens": 2048}
    cold_times: list[float] = []
    warm_times: list[float] = []
    checks: list[bool] = []
    for r in range(repeats):
        suffix = make_prompt(tokenizer, 20, random.Random(100 + r))
        params = SamplingParams(max_tokens=1, temperature=0.0)
        cold_engine = ours_engine(loaded, enable_prefix_caching=False, kv_cache_bytes=256 << 20, **budget)
        cold_token, cold = ttft(cold_engine, EngineRequest(f"cold{r}", prefix + suffix, params))
        warm_engine = ours_engine(loaded, kv_cache_bytes=256 << 20, **budget)
        ttft(warm_engine, EngineRequest(f"fill{r}", [*prefix, 7, 7], params))  # caches the prefix
        warm_token, warm = ttft(warm_engine, EngineRequest(f"warm{r}", prefix + suffix, params))
        cold_times.append(cold)
        warm_times.append(warm)
        checks.append(cold_token == warm_token)
    return {"cold_ttft_s": cold_times, "cached_ttft_s": warm_times,
            "speedup": statistics.median(cold_times) / statistics.median(warm_times), "first_tokens_equal": all(checks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="reduced sizes (< 1 minute)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both engines (1: the 2-core box is shared)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_at_start = list(__import__("os").getloadavg())

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_default_model(REPO / "data" / "models")
    config = ModelConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    loaded = (load_model(path, max_model_len=2048), config, tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # both run to each request's length (ignore_eos)
    hf.generation_config.pad_token_id = 0

    if args.quick:
        sizes = {"num": 8, "prompt_range": (20, 60), "output_range": (2, 8), "steps": 8, "repeats": 1,
                 "prefix_len": 160}
    else:
        sizes = {"num": 32, "prompt_range": (20, 400), "output_range": (16, 256), "steps": 128, "repeats": 3,
                 "prefix_len": 1000}
    # Warm both up (allocator, kernels) before anything is timed.
    warm_prompt = make_prompt(tokenizer, 30, random.Random(9))
    run_ours(ours_engine(loaded, kv_cache_bytes=64 << 20),
             [EngineRequest("warm", warm_prompt, SamplingParams(max_tokens=4, temperature=0.0))])
    hf.generate(input_ids=torch.tensor([warm_prompt]), max_new_tokens=4, do_sample=False)

    tp = throughput(loaded, hf, sizes["num"], sizes["prompt_range"], sizes["output_range"], seed=0)
    print(f"throughput: ours {tp['ours_tokens_per_s']:.1f} tok/s, transformers {tp['transformers_tokens_per_s']:.1f}"
          f" tok/s (total tokens), ratio {tp['ratio']:.2f}x; check {tp['check']}")
    b1 = batch1(loaded, hf, sizes["steps"], sizes["repeats"])
    print(f"batch-1 decode: ours {b1['ours_tokens_per_s']:.1f} tok/s, transformers {b1['transformers_tokens_per_s']:.1f}"
          f" tok/s, ratio {b1['ratio']:.2f}x; tokens equal {b1['tokens_equal']}")
    px = prefix_reuse(loaded, sizes["prefix_len"], sizes["repeats"])
    print(f"prefix TTFT: cold {statistics.median(px['cold_ttft_s']) * 1000:.0f} ms, cached "
          f"{statistics.median(px['cached_ttft_s']) * 1000:.0f} ms, speedup {px['speedup']:.1f}x; "
          f"first tokens equal {px['first_tokens_equal']}")

    checked = tp["check"]["identical"] == tp["check"]["requests"] and b1["tokens_equal"] and px["first_tokens_equal"]
    if args.quick:
        return
    result = {
        "benchmark": "engine_cpu",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": DEFAULT_MODEL_NAME, "dtype": "float32", "threads": args.threads,
                   "clock": "process CPU time (time.process_time), one intra-op thread each; wall times in raw",
                   "load_average_at_start": load_at_start, **{
            k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()}, "hf_batch": 8,
            "engine": {"block_size": 16, "max_num_batched_tokens": 512, "max_num_seqs": 64}},
        "metrics": {
            "throughput_ratio_vs_transformers": tp["ratio"],
            "batch1_ratio_vs_transformers": b1["ratio"],
            "prefix_ttft_speedup": px["speedup"],
            "ours_tokens_per_s": tp["ours_tokens_per_s"],
            "transformers_tokens_per_s": tp["transformers_tokens_per_s"],
            "ours_generated_tokens_per_s": tp["ours_generated_tokens_per_s"],
            "transformers_generated_tokens_per_s": tp["transformers_generated_tokens_per_s"],
            "batch1_ours_tokens_per_s": b1["ours_tokens_per_s"],
            "batch1_transformers_tokens_per_s": b1["transformers_tokens_per_s"],
            "prefix_cold_ttft_ms_median": statistics.median(px["cold_ttft_s"]) * 1000,
            "prefix_cached_ttft_ms_median": statistics.median(px["cached_ttft_s"]) * 1000,
        },
        "targets": {
            "throughput_ratio_vs_transformers": {"op": ">=", "value": 3.0},
            "batch1_ratio_vs_transformers": {"op": ">=", "value": 1.0},
            "prefix_ttft_speedup": {"op": ">=", "value": 5.0},
        },
        "checks": {"throughput": tp["check"], "batch1_tokens_equal": b1["tokens_equal"],
                   "prefix_first_tokens_equal": px["first_tokens_equal"]},
        "raw": {"throughput": {k: v for k, v in tp.items() if k != "check"}, "batch1": b1, "prefix": px},
        "checked": checked,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    sys.exit(main())
