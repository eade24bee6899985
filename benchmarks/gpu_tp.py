"""Tensor-parallel decode on random Llama-shaped bf16 weights, each step against its own floor.

For each (model, tensor_parallel_size) the run builds the engine (one worker process per extra
GPU, each drawing its shard on its GPU), checks its greedy output, then times engine steps
(host work included, CUDA graphs on) at batch 1 and at batch 64 with 1k context. A step's floor
is what one GPU must read: its shard of the weights (embedding excluded: one row per token)
plus, at batch 64, its KV heads' cache, over the card's measured copy bandwidth. Also: offline
throughput (256 requests x 512 in / 128 out) and its scaling over TP 1; at the largest TP, the
batch-64 step with 8 distinct rank-16 adapters (sharded, S-LoRA style) over the base step.

``python benchmarks/gpu_tp.py --tp 2`` (a 2-GPU machine: Llama-3.1-8B at TP 1 and 2) and
``--tp 4`` (4 GPUs: Llama-3.1-70B at TP 4, 8B at TP 4) merge their figures into
benchmarks/results/gpu_tp.json, each figure with the card kind it ran on. ``--quick`` runs on
the CPU: a tiny model over gloo at TP 1 and 2, tokens compared, steps timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import gpu_engine
import torch
import triton
from attention_kernels import copy_bandwidth_gbps
from gpu_engine import decode_steps_ms, lora_requests, preload, random_prompts, set_overlap, weight_bytes
from loraplex.engine.config import AdapterLimits, EngineConfig, ModelConfig
from loraplex.engine.cuda.random_weights import RandomAdapterSource, SyntheticTokenizer, named_config
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.parallel.sources import RandomModelSource
from loraplex.engine.protocol import EngineRequest, SamplingParams

RESULTS = Path(__file__).parent / "results" / "gpu_tp.json"
TARGETS = {
    "tp4_70b_decode_b1_fraction_of_roofline": {"op": ">=", "value": 0.70},
    "tp2_over_tp1_8b_b1_step": {"op": "<=", "value": 0.60},
    "tp4_lora_8_adapters_step_ratio": {"op": "<=", "value": 1.10},
}
# (model, tensor_parallel_size, engine overrides, tag suffix); the NCCL-only leg is the same run's
# baseline for the one-shot all-reduce
NCCL_ONLY = {"tp_one_shot_all_reduce": False}
PLANS = {
    2: [("Llama-3.1-8B", 1, {}, ""), ("Llama-3.1-8B", 2, {}, ""), ("Llama-3.1-8B", 2, NCCL_ONLY, "_nccl")],
    4: [("Llama-3.1-8B", 1, {}, ""), ("Llama-3.1-8B", 2, {}, ""), ("Llama-3.1-70B", 4, {}, ""),
        ("Llama-3.1-70B", 4, NCCL_ONLY, "_nccl"), ("Llama-3.1-8B", 2, NCCL_ONLY, "_nccl"), ("Llama-3.1-8B", 4, {}, "")],
}
# The check against one GPU: every tensor-parallel size holds the same weights (drawn whole on the
# host), float32, logits sharpened so that greedy tokens have no near-ties.
CHECK_CONFIG = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


_replay_one_rank = gpu_engine.graph_replay_ms


def _graph_replay_ms(engine: LLMEngine, batch: int, repeats: int = 20) -> float | None:
    """Replaying one rank's graph alone would wait forever in its all-reduce: TP 1 only."""
    return None if engine.runner.workers is not None else _replay_one_rank(engine, batch, repeats)


gpu_engine.graph_replay_ms = _graph_replay_ms


def card_kind() -> str:
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_properties(0).name
    return f"{count}x {name}"


def load_report(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"benchmark": "gpu_tp", "machines": {}, "config": {}, "metrics": {}, "targets": TARGETS, "checks": {},
            "checked": False}


def save(report: dict, path: Path) -> None:
    report["checked"] = bool(report["checks"]) and all(c["ok"] for c in report["checks"].values()) and any(
        name.endswith("equals_single_gpu_fp32") for name in report["checks"])
    text = json.dumps(report, indent=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(text)


def build_engine(config: ModelConfig, tp: int, source: RandomModelSource | None = None,
                 **overrides: object) -> LLMEngine:
    settings = {"block_size": 16, "max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 8192,
                "dtype": "bfloat16", "device": "cuda", "tensor_parallel_size": tp, "num_blocks": 64 * 72 + 64,
                "overlap_scheduling": True}
    source = source or RandomModelSource(config, seed=0, whole=False)
    return LLMEngine.from_source(source, EngineConfig(**settings | overrides), SyntheticTokenizer(config.vocab_size))


def kv_bytes_per_rank(config: ModelConfig, tp: int, tokens: float) -> float:
    kv_heads = max(1, config.num_key_value_heads // tp)
    return 2 * config.num_hidden_layers * kv_heads * config.head_dim * 2 * tokens


def check_against_single_gpu(report: dict, tp: int) -> None:
    """Greedy tokens (float32, CUDA graphs on) of a tensor-parallel size equal one GPU's on the same
    weights, for prompts of mixed lengths decoded together; one-shot all-reduce as configured. One
    size per call (per process: see `run_leg`); TP 1 records the reference tokens in the report."""
    config = ModelConfig.from_hf_dict(CHECK_CONFIG)
    source = RandomModelSource(config, seed=3, whole=True, lm_head_scale=10.0)
    prompts = [p[:n] for p, n in zip(random_prompts(6, 200, config.vocab_size, seed=11), (200, 7, 64, 130, 31, 96),
                                      strict=True)]
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = build_engine(config, tp, source, dtype="float32", num_blocks=512)
    engine.runner.capture_decode_graphs()
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"s{i}", p, sampling))
    produced: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced.setdefault(out.request_id, []).extend(t for c in out.choices for t in c.token_ids)
    one_shot = engine.runner.model.embed_tokens.tp.one_shot is not None if tp > 1 else None
    engine.close()
    if tp == 1:
        report["reference_tokens"] = produced
        return
    reference = report.get("reference_tokens", {})
    equal = sum(produced[k] == reference.get(k) for k in produced)
    check = {"ok": equal == len(prompts) and all(len(t) == 24 for t in produced.values()),
             "requests_equal": equal, "requests": len(prompts), "one_shot_all_reduce": one_shot}
    report["checks"][f"tp{tp}_greedy_equals_single_gpu_fp32"] = check
    print(f"  check tp{tp} vs single GPU: {check}", flush=True)


def check_greedy(engine: LLMEngine, config: ModelConfig) -> dict:
    """Graph decode and eager decode agree, and every request gets its tokens (a TP bug in a
    collective shows as garbage that differs between the two paths). Prefix caching is off for
    the check, so both runs prefill the same way."""
    prompts = random_prompts(4, 64, config.vocab_size, seed=6)
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.block_manager.enable_prefix_caching = False
    runs = []
    for graphs in (True, False):
        engine.runner.use_graphs = graphs
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"c{graphs}{i}", p, sampling))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id[-1], []).extend(t for c in out.choices for t in c.token_ids)
        runs.append(tokens)
    engine.runner.use_graphs = True
    engine.block_manager.enable_prefix_caching = True
    same = sum(runs[0][k][:4] == runs[1][k][:4] for k in runs[0])  # bf16: the first tokens agree
    return {"ok": same >= 3 and all(len(t) == 8 for t in runs[0].values()), "first4_equal": same, "requests": 4}


def offline_tokens_per_s(engine: LLMEngine, config: ModelConfig, count: int = 256) -> float:
    prompts = random_prompts(count, 512, config.vocab_size, seed=8)
    sampling = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"o{i}", p, sampling))
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += sum(len(c.token_ids) for c in out.choices)
    seconds = time.perf_counter() - start
    if produced != count * 128:
        raise RuntimeError(f"offline run produced {produced} tokens, expected {count * 128}")
    return produced / seconds


def measure(report: dict, name: str, tp: int, copy_gbps: float, kind: str, with_lora: bool,
            path: Path | None = None, overrides: dict | None = None, suffix: str = "") -> None:
    config = named_config(name)
    tag = f"{'70b' if '70B' in name else '8b'}_tp{tp}{suffix}"
    baseline_leg = bool(suffix)  # the NCCL-only comparison: decode steps only
    print(f"== {name} TP {tp}{suffix} on {kind}", flush=True)
    start = time.perf_counter()
    engine = build_engine(config, tp, **(overrides or {}))
    captured = engine.runner.capture_decode_graphs()
    metrics = report["metrics"]
    metrics[f"{tag}_startup_s"] = time.perf_counter() - start
    check = check_greedy(engine, config)
    report["checks"][f"{tag}_greedy_graphs_vs_eager"] = check
    print(f"  check {check}", flush=True)
    if tp > 1:
        metrics[f"{tag}_one_shot_all_reduce"] = engine.runner.model.embed_tokens.tp.one_shot is not None
    weights = weight_bytes(engine.runner.model)
    floor_b1 = weights / copy_gbps / 1e6
    one = random_prompts(1, 128, config.vocab_size, 9)
    set_overlap(engine, False)  # the same run's baseline: each step waits for the one before
    b1_alone = decode_steps_ms(engine, lora_requests(one, [None], 100), 60)
    set_overlap(engine, True)
    ahead = engine.overlap.num_steps_ahead
    b1 = decode_steps_ms(engine, lora_requests(one, [None], 100), 60)
    metrics[f"{tag}_decode_b1_steps_run_ahead"] = engine.overlap.num_steps_ahead - ahead
    metrics[f"{tag}_decode_b1_step_ms_no_overlap"] = b1_alone["step_ms"]
    prompts64 = random_prompts(64, 1024, config.vocab_size, 10)
    b64 = decode_steps_ms(engine, lora_requests(prompts64, [None], 40), 20)
    floor_b64 = (weights + kv_bytes_per_rank(config, tp, 64 * b64["mean_context"])) / copy_gbps / 1e6
    metrics.update({
        f"{tag}_card": kind, f"{tag}_graphs_captured": captured, f"{tag}_weight_bytes_per_rank": weights,
        f"{tag}_decode_b1_step_ms": b1["step_ms"], f"{tag}_decode_b1_graph_replay_ms": b1["graph_replay_ms"],
        f"{tag}_decode_b1_floor_ms": floor_b1, f"{tag}_decode_b1_fraction_of_roofline": floor_b1 / b1["step_ms"],
        f"{tag}_decode_b64_step_ms": b64["step_ms"], f"{tag}_decode_b64_graph_replay_ms": b64["graph_replay_ms"],
        f"{tag}_decode_b64_floor_ms": floor_b64,
        f"{tag}_decode_b64_fraction_of_roofline": floor_b64 / b64["step_ms"],
        f"{tag}_decode_b1_host_split_ms": b1["host_split_ms"], f"{tag}_decode_b64_host_split_ms": b64["host_split_ms"],
    })
    print({k: v for k, v in metrics.items() if k.startswith(tag + "_")}, flush=True)
    if with_lora:
        source = RandomAdapterSource(config, rank=16, dtype=torch.bfloat16, device="cpu", std=0.01)
        manager = engine.serve_adapters(source, AdapterLimits(max_loras=8, max_cpu_loras=8, max_lora_rank=16))
        adapters = [f"a{i}" for i in range(8)]
        preload(manager, adapters)
        base = decode_steps_ms(engine, lora_requests(prompts64, [None], 40), 20)
        eight = decode_steps_ms(engine, lora_requests(prompts64, adapters, 40), 20)
        metrics.update({f"{tag}_lora_base_step_ms": base["step_ms"], f"{tag}_lora_8_step_ms": eight["step_ms"],
                        f"{tag}_lora_8_adapters_step_ratio": eight["step_ms"] / base["step_ms"],
                        f"{tag}_lora_8_graph_replay_ratio": (eight["graph_replay_ms"] or 0)
                        / (base["graph_replay_ms"] or 1)})
        print(f"  lora 8/base = {eight['step_ms'] / base['step_ms']:.3f}", flush=True)
        engine.stop_serving_adapters(manager)
    if not baseline_leg:
        metrics[f"{tag}_offline_tokens_per_s"] = offline_tokens_per_s(engine, config)
        print(f"  offline {metrics[f'{tag}_offline_tokens_per_s']:.0f} tok/s", flush=True)
    headline(report)
    save(report, RESULTS if path is None else path)
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def headline(report: dict) -> None:
    m = report["metrics"]
    pairs = {
        "tp4_70b_decode_b1_fraction_of_roofline": m.get("70b_tp4_decode_b1_fraction_of_roofline"),
        "tp4_70b_decode_b64_fraction_of_roofline": m.get("70b_tp4_decode_b64_fraction_of_roofline"),
        "tp4_lora_8_adapters_step_ratio": m.get("70b_tp4_lora_8_adapters_step_ratio"),
    }
    if "8b_tp1_decode_b1_step_ms" in m and "8b_tp2_decode_b1_step_ms" in m:
        pairs["tp2_over_tp1_8b_b1_step"] = m["8b_tp2_decode_b1_step_ms"] / m["8b_tp1_decode_b1_step_ms"]
        pairs["tp2_over_tp1_8b_offline_throughput"] = m["8b_tp2_offline_tokens_per_s"] / m["8b_tp1_offline_tokens_per_s"]
    if "8b_tp1_decode_b1_step_ms" in m and "8b_tp2_nccl_decode_b1_step_ms" in m:
        pairs["tp2_over_tp1_8b_b1_step_nccl_only"] = m["8b_tp2_nccl_decode_b1_step_ms"] / m["8b_tp1_decode_b1_step_ms"]
    pairs["tp4_70b_decode_b1_fraction_of_roofline_nccl_only"] = m.get("70b_tp4_nccl_decode_b1_fraction_of_roofline")
    if "8b_tp1_offline_tokens_per_s" in m and "8b_tp4_offline_tokens_per_s" in m:
        pairs["tp4_over_tp1_8b_offline_throughput"] = m["8b_tp4_offline_tokens_per_s"] / m["8b_tp1_offline_tokens_per_s"]
    m.update({k: v for k, v in pairs.items() if v is not None})
    m["card_kind_per_figure"] = {
        "tp4_70b_decode_b1_fraction_of_roofline": m.get("70b_tp4_card"),
        "tp4_70b_decode_b64_fraction_of_roofline": m.get("70b_tp4_card"),
        "tp4_lora_8_adapters_step_ratio": m.get("70b_tp4_card"),
        "tp2_over_tp1_8b_b1_step": m.get("8b_tp2_card"),
    }


# A tiny random Llama for the CPU check: wide init for peaked logits, so greedy argmax is never a float-noise tie.
TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "initializer_range": 0.2,
    "eos_token_id": 2,
}


def quick() -> None:
    """CPU, gloo: a tiny Llama at TP 1 and TP 2, greedy tokens compared, engine steps timed."""
    torch.set_num_threads(1)
    config = ModelConfig.from_hf_dict(dict(TINY_LLAMA))
    tokens, step_ms = {}, {}
    for tp in (1, 2):
        settings = EngineConfig(num_blocks=64, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
                                tensor_parallel_size=tp)
        engine = LLMEngine.from_source(RandomModelSource(config, seed=0, lm_head_scale=10.0), settings,
                                       SyntheticTokenizer(1000))
        for i, p in enumerate(random_prompts(4, 24, 1000, seed=1)):
            engine.add_request(EngineRequest(f"q{i}", p, SamplingParams(max_tokens=12, temperature=0.0,
                                                                       ignore_eos=True)))
        produced: dict[str, list[int]] = {}
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outs = engine.step()
            times.append((time.perf_counter() - start) * 1e3)
            for out in outs:
                produced.setdefault(out.request_id, []).extend(t for c in out.choices for t in c.token_ids)
        tokens[tp], step_ms[tp] = produced, statistics.median(times)
        engine.close()
    print(f"quick (CPU, gloo): tokens equal {tokens[1] == tokens[2]}; median step ms TP1 {step_ms[1]:.2f}, "
          f"TP2 {step_ms[2]:.2f} (CPU timings say nothing about GPUs)")
    if tokens[1] != tokens[2]:
        raise SystemExit("TP 2 tokens differ from TP 1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU: tiny model over gloo")
    parser.add_argument("--tp", type=int, choices=sorted(PLANS), default=2, help="the machine's GPU count plan")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--leg", help="run one leg and merge it into the results: checkN (N = TP size) or "
                                      "MODEL:TP[_nccl] from the plan; default: a fresh report, then every leg "
                                      "(each engine in this process)")
    options = parser.parse_args()
    if options.quick or not torch.cuda.is_available():
        quick()
        return
    kind = card_kind()
    if options.leg is None:
        report = new_report(kind)
        sizes = [1, 2, 4][: {2: 2, 4: 3}[options.tp]]
        legs = [f"check{n}" for n in sizes] + [f"{name}:{tp}{suffix}" for name, tp, _, suffix in PLANS[options.tp]]
    else:
        report = load_report(options.output)
        if kind not in report.get("machines", {}):
            report = new_report(kind)
        legs = [options.leg]
    for leg in legs:
        run_leg(report, leg, options.tp, kind, options.output)
    print(json.dumps({k: v for k, v in report["metrics"].items() if not isinstance(v, dict)}, indent=1))


def new_report(kind: str) -> dict:
    """A results file for this machine alone: every baseline comes from the same machine."""
    props = torch.cuda.get_device_properties(0)
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "gpu": props.name,
               "gpus": torch.cuda.device_count(), "gpu_memory_gib": round(props.total_memory / 2**30, 1),
               "torch": torch.__version__, "triton": triton.__version__,
               "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
               "torch_symm_mem_disable_multicast": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")}
    report = {"benchmark": "gpu_tp", "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "machine": machine | {"gpu": kind}, "machines": {kind: machine}, "metrics": {}, "targets": TARGETS,
              "checks": {}, "checked": False}
    report["config"] = {
        "models": "Llama-3.1-8B and Llama-3.1-70B shapes, random bf16 weights (std 0.02), each rank drawing its shard",
        "decode": "engine step wall time (host work included), CUDA graphs and overlapped scheduling on (every rank "
                  "launches step N+1 before step N's tokens reach the host; b1 also without), max_num_seqs 64; "
                  "floors = one rank's "
                  "weight shard (embedding excluded) [+ its KV heads' cache at b64] / measured copy bandwidth",
        "all_reduce": "one-shot over symmetric memory (no multicast) for messages <= 2 MiB, NCCL above; legs "
                      "suffixed _nccl use NCCL for every all-reduce (the same run's baseline)",
        "check": "greedy tokens of TP 2 and 4 equal TP 1's, float32, same weights drawn whole (4 layers, "
                 "hidden 2048), 6 prompts of mixed lengths x 24 tokens, CUDA graphs on",
        "lora": "rank 16 on q,k,v,o,gate,up,down, 8 distinct adapters round-robin over 64 sequences at context ~1k",
        "offline": "256 requests x (512 prompt, exactly 128 new tokens), all admitted at once",
    }
    report["metrics"][f"copy_bandwidth_gbps_{kind}"] = copy_bandwidth_gbps()
    return report


def run_leg(report: dict, leg: str, plan: int, kind: str, path: Path) -> None:
    """One leg. Symmetric memory is set up once per process, so a leg that should use the one-shot
    all-reduce after another TP engine in the same process runs with NCCL (run legs as processes)."""
    if leg.startswith("check"):
        print(f"== {leg}: TP {leg[5:]} against one GPU", flush=True)
        check_against_single_gpu(report, int(leg[5:]))
    else:
        for name, tp, overrides, suffix in PLANS[plan]:
            if leg == f"{name}:{tp}{suffix}":
                copy_gbps = report["metrics"][f"copy_bandwidth_gbps_{kind}"]
                measure(report, name, tp, copy_gbps, kind, with_lora=tp == 4 and "70B" in name and not suffix,
                        path=path, overrides=overrides, suffix=suffix)
                break
        else:
            raise SystemExit(f"no leg {leg!r} in the {plan}-GPU plan")
    save(report, path)


if __name__ == "__main__":
    main()
