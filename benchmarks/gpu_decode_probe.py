"""Where a decode step's GPU time goes, and which fused variant removes it (H100, 8B shapes).

One call: (1) the batch-1 GEMV sweep, cuBLAS `F.linear` against Triton `gemv` block shapes, on
each 8B projection shape, timed as back-to-back calls over 8 distinct weight copies in a CUDA
graph (as a decode step reads its layers), after a check against float64; (2) the engine's
decode graph replay at batch 1 and 64 for three variants: unfused, fused elementwise ops
(add+RMSNorm, SiLU x mul, rotary+KV write), fused + GEMV; greedy tokens of the variants and of
overlap on/off compared; (3) a torch.profiler table of the b1 step's kernels per variant;
(4) LoRA-8 at batch 64: base vs adapters replay ratio with the LoRA work after each GEMM or beside it
on a side stream (`engine/cuda/lora_overlap.py`), greedy tokens compared, with a profile; with
--lora-gemm first the one-launch GEMM + LoRA kernel (`engine/kernels/lora_gemm.py`) per shape and
config, then the engine's LoRA-8 ratio with it ("fused") and without. `--skinny` sweeps the skinny GEMM
against cuBLAS for steps of 2 to 128 rows (`--write-table` rewrites `engine/cuda/skinny_gemm.py`'s table);
`--skinny-model smollm2` and `--lora-gemm-shapes smollm2` take the bundled SmolLM2-135M's shapes instead.
Writes $OUT/gpu_decode_probe.json (or benchmarks/results/) and prints a short table last.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

sys.path.insert(0, str(Path(__file__).parent))

RESULT = {}


def out_path() -> Path:
    return Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "gpu_decode_probe.json"


def save() -> None:
    out_path().parent.mkdir(parents=True, exist_ok=True)
    out_path().write_text(json.dumps(RESULT, indent=1, default=str))


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}
CONFIGS = [(4, 512, 4, 3), (8, 512, 4, 3), (8, 256, 4, 3), (8, 1024, 4, 3), (8, 1024, 8, 3), (16, 512, 4, 3),
           (16, 512, 8, 3), (16, 256, 4, 4), (32, 256, 8, 3), (4, 1024, 4, 2), (8, 512, 4, 1), (16, 1024, 8, 2),
           (2, 1024, 4, 3), (4, 2048, 8, 2)]


def graph_time_us(fn, copies: int, repeats: int = 20) -> float:
    """Per-call µs of `fn(i)` for i in range(copies) (distinct weight copies, so that no call finds its
    weights in L2), the copies captured in one graph, median of replays."""
    from attention_kernels import time_graph_us

    calls = itertools.count()
    return time_graph_us(lambda: fn(next(calls) % copies), repeats=repeats, calls_per_graph=copies)


def gemv_sweep(copy_gbps: float) -> dict:
    import torch.nn.functional as F
    from attention_kernels import relative_error
    from loraplex.engine.cuda.gemv import gemv

    table = {}
    for name, (n, k) in SHAPES.items():
        copies = 4 if name == "head" else 8
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        floor_us = n * k * 2 / copy_gbps / 1e3
        ref = F.linear(xs[0].double(), weights[0].double())
        row = {"floor_us": floor_us,
               "cublas_us": graph_time_us(lambda i, xs=xs, weights=weights: F.linear(xs[i], weights[i]), copies)}
        row["cublas_err"] = relative_error(F.linear(xs[0], weights[0]), ref)
        best = None
        for config in CONFIGS:
            try:
                err = relative_error(gemv(xs[0], weights[0], config=config), ref)
                us = graph_time_us(lambda i, c=config, xs=xs, weights=weights: gemv(xs[i], weights[i], config=c), copies)
            except Exception as exc:  # a config that does not compile is skipped
                row[str(config)] = f"error {type(exc).__name__}: {str(exc)[:80]}"
                continue
            row[str(config)] = {"us": us, "err": err}
            if err < 2 * row["cublas_err"] + 1e-3 and (best is None or us < best[1]):
                best = (config, us)
        row["best"] = best
        table[name] = row
        print(f"gemv {name:8s} floor {floor_us:7.1f} cublas {row['cublas_us']:7.1f} ({floor_us / row['cublas_us']:.3f})"
              f" best {best[0]} {best[1]:7.1f} ({floor_us / best[1]:.3f})", flush=True)
        del weights, xs
        torch.cuda.empty_cache()
    return table


def profile_graph(graph, steps: int = 5) -> list:
    """Kernel name -> µs per replay, largest first. Take it after the process's last LoRA graph capture: a capture
    after a profiler session ended in a device-side assert (H200, torch 2.11)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.forward.replay()
            graph.sample.replay()
        torch.cuda.synchronize()
    sums: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            key = event.name[:70]
            sums[key][0] += event.device_time / steps
            sums[key][1] += 1 / steps
    rows = sorted(([k, round(v[0], 1), round(v[1], 1)] for k, v in sums.items()), key=lambda r: -r[1])
    return rows


def set_variant(engine, elementwise: bool, gemv: bool) -> None:
    from loraplex.engine.cuda.fused_ops import fuse_model

    fuse_model(engine.runner.model, elementwise=elementwise, gemv=gemv)
    engine.runner.attention_backend.fuse_rotary_kv_write = elementwise
    engine.runner.release_graphs()


def greedy_tokens(engine, prompts, max_tokens: int, overlap: bool) -> list:
    from gpu_engine import set_overlap
    from loraplex.engine.protocol import EngineRequest, SamplingParams

    set_overlap(engine, overlap)
    engine.block_manager.enable_prefix_caching = False
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"g{time.monotonic_ns()}_{i}", p,
                                         SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    tokens: dict[int, list[int]] = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[int(out.request_id.rsplit("_", 1)[1])].extend(t for c in out.choices for t in c.token_ids)
    engine.block_manager.enable_prefix_caching = True
    return [tokens[i] for i in range(len(prompts))]


GEMM_CONFIGS = [  # block_n, block_k, warps, stages, shrink split_k, shrink block_k, g_chunk, GEMM K splits
    # for SmolLM2 (K 576): small blocks, the whole K in one shrink program
    (16, 64, 4, 4, 1024, 64, 4, 1), (32, 64, 4, 4, 1024, 64, 4, 1), (64, 64, 4, 4, 1024, 64, 4, 1),
    (32, 128, 4, 4, 1024, 128, 4, 1), (64, 128, 4, 4, 1024, 128, 4, 1), (128, 64, 4, 4, 1024, 128, 4, 1),
    (128, 128, 8, 3, 1024, 128, 4, 1), (64, 128, 4, 4, 1024, 128, 4, 2), (128, 128, 4, 3, 1024, 128, 4, 4),
    (128, 64, 4, 4, 1024, 128, 4, 2), (64, 256, 4, 3, 2048, 128, 4, 2), (32, 256, 4, 3, 2048, 128, 4, 2),
    (128, 128, 8, 3, 2048, 128, 4, 4),
    # for the 70B's shards at TP 4: K 8192 with few output blocks (qkv 2560 columns) wants GEMM K splits
    (32, 128, 4, 4, 2048, 128, 4, 4), (64, 128, 4, 3, 2048, 128, 4, 4), (32, 256, 4, 3, 2048, 128, 4, 4),
    (64, 256, 4, 3, 2048, 128, 4, 4), (128, 128, 8, 3, 2048, 128, 4, 2), (32, 128, 4, 4, 2048, 128, 4, 8),
    # eight adapter groups in one epilogue dot (no second chunk after the wait)
    (32, 128, 4, 4, 1024, 128, 8, 1), (64, 128, 4, 4, 1024, 128, 8, 1), (128, 128, 8, 3, 1024, 128, 8, 1),
    (64, 256, 4, 3, 2048, 128, 8, 2), (64, 128, 4, 4, 1024, 128, 8, 2)]


# Per-rank (out slice sizes, in features) of each LoRA linear: the 8B on one GPU, the 70B's shards at TP 4
# (q/k/v and gate/up split by output, o and down by input, as engine/parallel/plan.py shards them)
LORA_GEMM_SHAPES = {
    "8b": {"qkv": ((4096, 1024, 1024), 4096), "o": ((4096,), 4096), "gate_up": ((14336, 14336), 4096),
           "down": ((4096,), 14336)},
    "70b-tp4": {"qkv": ((2048, 256, 256), 8192), "o": ((8192,), 2048), "gate_up": ((7168, 7168), 8192),
                "down": ((8192,), 7168)},
    "smollm2": {"qkv": ((576, 192, 192), 576), "o": ((576,), 576), "gate_up": ((1536, 1536), 576),
                "down": ((576,), 1536)},
}


def lora_gemm_sweep(copy_gbps: float, rows: int = 64, adapters: int = 8, model: str = "8b") -> dict:
    """Per 8B shape at `rows` decode rows (8 adapters of rank 16 in a 64-slot pool, 8 rows each):
    cuBLAS alone, cuBLAS + the separate LoRA kernel (today's path), and the one-launch
    `lora_gemm.linear_with_lora` per config (with adapters, and with every row on the base model),
    µs per call over 4 distinct weight and stack copies in one graph, each checked against the reference."""
    import torch.nn.functional as F
    from attention_kernels import relative_error
    from loraplex.engine.kernels.lora_gemm import LoRAGemmConfig, linear_with_lora
    from loraplex.engine.kernels.lora_metadata import build_lora_metadata
    from loraplex.engine.kernels.lora_reference import add_lora_ref
    from loraplex.engine.kernels.lora_triton import add_lora
    from loraplex.engine.kernels.lora_weights import LoRAStack

    shapes = LORA_GEMM_SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    slots = [i % adapters for i in range(rows)]
    meta = build_lora_metadata(slots, max_loras=64, device="cuda")
    base_meta = build_lora_metadata([-1] * rows, max_loras=64, device="cuda")
    out = {}

    def one_shape(name: str, out_sizes: tuple[int, ...], k: int) -> None:
        n = sum(out_sizes)
        copies = 4
        ws = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        stacks = []
        for _ in range(copies):
            st = LoRAStack.allocate(num_slots=64, max_rank=16, in_features=k, out_sizes=out_sizes,
                                    dtype=torch.bfloat16, device="cuda")
            st.lora_a.normal_(generator=gen).mul_(k**-0.5)
            st.lora_b.normal_(generator=gen).mul_(0.25)
            st.ranks.fill_(16)
            st.scalings.fill_(2.0)
            stacks.append(st)
        xs = [torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(copies)]
        ys = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        floor_us = (n * k * 2 + rows * (n + k) * 2) / copy_gbps / 1e3
        expected = F.linear(xs[0], ws[0])
        add_lora_ref(expected, xs[0], stacks[0], meta)
        row = out[name] = {"floor_us": floor_us, "n": n, "k": k}
        row["cublas_us"] = graph_time_us(lambda i: torch.matmul(xs[i], ws[i].T, out=ys[i]), copies)

        def separate(i):
            torch.matmul(xs[i], ws[i].T, out=ys[i])
            add_lora(ys[i], xs[i], stacks[i], meta)

        row["cublas_plus_lora_us"] = graph_time_us(separate, copies)
        best = None
        for cfg in GEMM_CONFIGS:
            config = LoRAGemmConfig(*cfg)
            try:
                got = linear_with_lora(xs[0], ws[0], stacks[0], meta, config=config)
                err = relative_error(got, expected)
                us = graph_time_us(lambda i, c=config: linear_with_lora(xs[i], ws[i], stacks[i], meta, config=c,
                                                                        out=ys[i]), copies)
                plain = linear_with_lora(xs[0], ws[0], stacks[0], base_meta, config=config, has_lora=False)
                plain_err = relative_error(plain, F.linear(xs[0], ws[0]))
                plain_us = graph_time_us(lambda i, c=config: linear_with_lora(
                    xs[i], ws[i], stacks[i], base_meta, config=c, out=ys[i], has_lora=False), copies)
                row[str(cfg)] = {"us": us, "plain_gemm_us": plain_us, "err": err, "plain_err": plain_err,
                                 "synced": not meta.sync.any().item() and not base_meta.sync.any().item()}
                print(f"   {name:8s} {cfg} fused {us:6.1f} (err {err:.1e}) plain GEMM {plain_us:6.1f} "
                      f"(err {plain_err:.1e})", flush=True)
                if err < 2e-2 and (best is None or us < best[1]):
                    best = (cfg, us)
            except Exception as exc:  # a config that does not fit (shared memory) is recorded, not fatal
                row[str(cfg)] = {"error": repr(exc)[:200]}
        row["best"] = best
        print(f"lora_gemm {name:8s} floor {floor_us:6.1f} cublas {row['cublas_us']:6.1f} +lora "
              f"{row['cublas_plus_lora_us']:6.1f} fused best {best}", flush=True)

    for name, (out_sizes, k) in shapes.items():
        one_shape(name, out_sizes, k)
        gc.collect()
        torch.cuda.empty_cache()
    return out


def engine_variants(copy_gbps: float, lora_only: bool = False) -> None:
    from gpu_engine import (
        decode_steps_ms,
        engine_for,
        kv_bytes,
        lora_requests,
        preload,
        random_prompts,
        set_overlap,
        weight_bytes,
    )
    from loraplex.engine.config import AdapterLimits
    from loraplex.engine.cuda.random_weights import RandomAdapterSource, named_config, random_device_model

    config = named_config("Llama-3.1-8B")
    model = random_device_model(config, 2048, device="cuda", dtype=torch.bfloat16)
    floor_b1 = weight_bytes(model) / copy_gbps / 1e6
    engine = engine_for(model, config, num_blocks=64 * 72 + 64)
    prompts1 = random_prompts(1, 128, config.vocab_size, 9)
    prompts64 = random_prompts(64, 1024, config.vocab_size, 10)
    check_prompts = random_prompts(1, 64, config.vocab_size, 12)
    variants = {"unfused": (False, False), "fused_elementwise": (True, False), "fused_gemv": (True, True)}
    if lora_only:
        variants = {"fused_gemv": (True, True)}
    tokens = {}
    RESULT["variants"] = {}
    for name, (elementwise, gemv) in variants.items():
        set_variant(engine, elementwise, gemv)
        row = RESULT["variants"][name] = {}
        tokens[name] = greedy_tokens(engine, check_prompts, 24, overlap=False)
        if gemv:
            on = greedy_tokens(engine, check_prompts, 24, overlap=True)
            row["b1_overlap_tokens_equal"] = on == tokens[name]
        set_overlap(engine, True)
        b1 = decode_steps_ms(engine, lora_requests(prompts1, [None], 100), 60)
        row["b1_step_ms"], row["b1_replay_ms"] = b1["step_ms"], b1["graph_replay_ms"]
        row["b1_fraction"] = floor_b1 / b1["step_ms"]
        row["b1_replay_fraction"] = floor_b1 / b1["graph_replay_ms"]
        row["b1_profile"] = profile_graph(engine.runner.graphs[(1, None)])
        b64 = decode_steps_ms(engine, lora_requests(prompts64, [None], 40), 20)
        floor64 = (weight_bytes(model) + kv_bytes(config, 64 * b64["mean_context"])) / copy_gbps / 1e6
        row["b64_step_ms"], row["b64_replay_ms"], row["b64_fraction"] = (
            b64["step_ms"], b64["graph_replay_ms"], floor64 / b64["step_ms"])
        print(f"{name:18s} b1 {b1['step_ms']:.3f} ms (replay {b1['graph_replay_ms']:.3f}) frac {row['b1_fraction']:.3f}"
              f" | b64 {b64['step_ms']:.3f} (replay {b64['graph_replay_ms']:.3f}) frac {row['b64_fraction']:.3f}",
              flush=True)
        save()
    RESULT["tokens_equal_vs_unfused"] = {name: t == tokens.get("unfused") for name, t in tokens.items()}
    print("tokens equal vs unfused:", RESULT["tokens_equal_vs_unfused"], flush=True)
    save()

    # LoRA-8 at batch 64 on the fused variant: the LoRA work after each GEMM, or beside it on a side stream
    source = RandomAdapterSource(config, rank=16, dtype=torch.bfloat16, device="cuda", std=0.01)
    manager = engine.serve_adapters(source, AdapterLimits(max_loras=64, max_cpu_loras=64, max_lora_rank=16))
    preload(manager, [f"a{i}" for i in range(8)])
    set_overlap(engine, True)
    base = decode_steps_ms(engine, lora_requests(prompts64, [None], 40), 20)
    RESULT["lora"] = {"base_replay_ms": base["graph_replay_ms"], "base_step_ms": base["step_ms"]}
    lora_tokens = {}
    import dataclasses

    from loraplex.engine.kernels import lora_triton

    original = lora_triton.choose_config
    tweaks = {"no_rank_wait": {"rank_masked_loads": False},
              "no_rank_wait_stages2": {"rank_masked_loads": False, "num_stages": 2},
              "no_rank_wait_bk128": {"rank_masked_loads": False, "block_k": 128}}
    from loraplex.engine.lora import step as lora_step

    fused_rows = lora_step.FUSED_LINEAR_ROWS
    runs = [(None, None), ("delta", None), ("shrink", None)] if not lora_only else [(None, None), ("fused", None)]
    if not lora_only:
        runs += [(None, tweak) for tweak in tweaks]
    for mode, tweak in runs:
        name = str(mode) if tweak is None else tweak
        # "fused": base GEMM and LoRA delta in one launch (`lora_gemm`); every other run keeps them apart
        lora_step.FUSED_LINEAR_ROWS = fused_rows if mode == "fused" else range(0)
        engine.runner.lora_overlap = None if mode == "fused" else mode
        lora_triton.choose_config = original if tweak is None else (
            lambda stack, meta, t=tweaks[tweak]: original(stack, meta) if meta.num_tokens > 256
            else dataclasses.replace(original(stack, meta), **t))
        for key in [key for key in engine.runner.graphs if key[1] == "lora"]:
            engine.runner.graphs.pop(key)
        set_overlap(engine, False)
        engine.block_manager.enable_prefix_caching = False  # every pass prefills the same way
        # 18 sequences (a decode graph of 32 rows, over the fused path's 16-row minimum): 8 adapters and base rows
        requests = lora_requests(random_prompts(18, 64, config.vocab_size, 13), [f"a{i}" for i in range(8)] + [None],
                                 16)
        for request in requests:
            engine.add_request(request)
        got: dict[str, list[int]] = defaultdict(list)
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id].extend(t for c in out.choices for t in c.token_ids)
        lora_tokens[name] = [got[r.request_id] for r in requests]
        engine.block_manager.enable_prefix_caching = True
        set_overlap(engine, True)
        eight = decode_steps_ms(engine, lora_requests(prompts64, [f"a{i}" for i in range(8)], 40), 20)
        RESULT["lora"][name] = {"step_ms": eight["step_ms"], "replay_ms": eight["graph_replay_ms"],
                                "replay_ratio": eight["graph_replay_ms"] / base["graph_replay_ms"],
                                "step_ratio": eight["step_ms"] / base["step_ms"],
                                "tokens_equal_vs_none": lora_tokens[name] == lora_tokens["None"],
                                "token_match_fraction_vs_none": sum(
                                    a == b for x, y in zip(lora_tokens[name], lora_tokens["None"], strict=True)
                                    for a, b in zip(x, y, strict=True)) / sum(len(x) for x in lora_tokens["None"])}
        lora_triton.choose_config = original
        RESULT["lora"][name]["profile"] = profile_graph(engine.runner.graphs[(64, "lora")], steps=3)[:12]
        print(f"lora8 {name:20s} step ratio {eight['step_ms'] / base['step_ms']:.3f} replay ratio "
              f"{eight['graph_replay_ms'] / base['graph_replay_ms']:.3f} tokens equal "
              f"{RESULT['lora'][name]['tokens_equal_vs_none']}", flush=True)
        save()
    lora_triton.choose_config = original
    lora_step.FUSED_LINEAR_ROWS = fused_rows
    engine.stop_serving_adapters(manager)
    del engine, manager, model
    gc.collect()
    torch.cuda.empty_cache()


def tp_profile(tp: int = 2, steps: int = 10) -> None:
    """Where a tensor-parallel batch-1 step's time goes on rank 0: wall time per engine step against
    the GPU's kernel time per step (collectives included: a one-shot all-reduce's kernel also waits
    for the peer), top kernels."""
    from gpu_engine import random_prompts
    from gpu_tp import build_engine
    from loraplex.engine.cuda.random_weights import named_config
    from loraplex.engine.protocol import EngineRequest, SamplingParams
    from torch.profiler import ProfilerActivity, profile

    config = named_config("Llama-3.1-8B")
    engine = build_engine(config, tp)
    engine.runner.capture_decode_graphs()
    prompt = random_prompts(1, 128, config.vocab_size, 9)[0]
    engine.add_request(EngineRequest("p0", prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)))
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    sums: dict[str, list] = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_index == 0:
            sums[event.name[:70]][0] += event.device_time / steps
            sums[event.name[:70]][1] += 1 / steps
            total += event.device_time / steps
    rows = sorted(([k, round(v[0], 1), round(v[1], 1)] for k, v in sums.items()), key=lambda r: -r[1])
    RESULT[f"tp{tp}_b1_profile"] = {"wall_ms_per_step_profiled": wall_ms, "kernel_ms_per_step": total / 1e3,
                                    "kernels": rows[:20]}
    print(f"tp{tp} b1: wall {wall_ms:.3f} ms/step (profiled), kernels {total / 1e3:.3f} ms/step on rank 0", flush=True)
    for r in rows[:14]:
        print("  ", r)
    save()
    engine.close()


# SmolLM2-135M (the bundled model): hidden 576, 9 query and 3 KV heads of 64, MLP 1536, 49152-token head
SMOLLM2_CONFIG = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}
SKINNY_SHAPES = {
    "8b": {**{name: shape for name, shape in SHAPES.items() if name != "head"},
           "head_smollm2": (49152, 4096)},  # batch.py's body shapes keep SmolLM2's vocabulary
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                "head": (49152, 576)},
}
SKINNY_ROWS = (2, 8, 16, 32, 48, 64, 80, 128)
SKINNY_CONFIGS = {  # block_n, block_k, warps, stages, K splits
    "8b": [(64, 128, 4, 4, 1), (64, 128, 4, 4, 2), (64, 128, 4, 4, 4), (64, 256, 4, 3, 1), (128, 128, 4, 3, 1),
           (128, 128, 8, 4, 1), (128, 64, 4, 5, 1), (64, 64, 4, 6, 2), (32, 128, 4, 4, 2), (128, 128, 8, 3, 2)],
    # A 576-wide layer is a few microseconds of latency, not of bandwidth: small blocks, many programs, one launch
    # (an earlier sweep's K tiles of 64-128 took 460-570 µs a step where cuBLAS took ~500: each K tile is one more
    # round trip to memory; the one-row GEMV reads a row's whole K at once). Here K in one or two tiles.
    "smollm2": [(64, 128, 4, 4, 1), (16, 128, 4, 3, 1), (16, 1024, 4, 1, 1), (16, 512, 4, 1, 1), (16, 512, 4, 2, 1),
                (32, 512, 4, 1, 1), (32, 1024, 4, 1, 1), (16, 256, 4, 2, 1), (16, 1024, 2, 1, 1), (16, 512, 2, 1, 1),
                (64, 512, 4, 1, 1)],
}


def skinny_sweep(copy_gbps: float, rows: tuple[int, ...] = SKINNY_ROWS, model: str = "8b") -> dict:
    """Per shape and row count: cuBLAS and each `skinny_gemm` config, µs per call over distinct weight copies in
    one graph, each result checked against float64 (a config must be within 2x cuBLAS's error to count)."""
    import torch.nn.functional as F
    from attention_kernels import relative_error
    from loraplex.engine.cuda.skinny_gemm import SkinnyConfig, skinny_gemm

    table = {}
    for name, (n, k) in SKINNY_SHAPES[model].items():
        copies = 3 if n > 100_000 else 8
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        floor_us = n * k * 2 / copy_gbps / 1e3
        table[name] = {"n": n, "k": k, "floor_us": floor_us, "rows": {}}
        for m in rows:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            ref = F.linear(xs[0].double(), weights[0].double())
            row = {"cublas_us": graph_time_us(lambda i, xs=xs, weights=weights: F.linear(xs[i], weights[i]), copies),
                   "cublas_err": relative_error(F.linear(xs[0], weights[0]), ref), "configs": {}}
            best = None
            for values in SKINNY_CONFIGS[model]:
                config = SkinnyConfig(*values)
                try:
                    err = relative_error(skinny_gemm(xs[0], weights[0], config=config), ref)
                    us = graph_time_us(lambda i, c=config, xs=xs, weights=weights: skinny_gemm(xs[i], weights[i], config=c),
                                       copies)
                except Exception as exc:  # a config that does not fit (shared memory, registers) is skipped
                    row["configs"][str(values)] = f"error {type(exc).__name__}: {str(exc)[:80]}"
                    continue
                row["configs"][str(values)] = {"us": round(us, 2), "err": err}
                if err < 2 * row["cublas_err"] + 1e-3 and (best is None or us < best[1]):
                    best = (values, us)
            row["best"] = best
            table[name]["rows"][m] = row
            print(f"skinny {name:12s} m {m:3d} floor {floor_us:7.1f} cublas {row['cublas_us']:7.1f} best "
                  f"{best[0] if best else None} {best[1] if best else float('nan'):7.1f}", flush=True)
            save()
        del weights
        torch.cuda.empty_cache()
    return table


def skinny_table(sweep: dict, margin: float = 0.98) -> dict:
    """`skinny_gemm.TUNED` updated from a sweep: per shape, rising row bounds, each the best config where it beats
    cuBLAS by more than 2% (else None: cuBLAS); row bounds the sweep did not measure keep the module's entries."""
    from loraplex.engine.cuda import skinny_gemm

    tuned = {shape: dict(entries) for shape, entries in skinny_gemm.TUNED.items()}
    for row in sweep.values():
        entries = tuned.setdefault((row["n"], row["k"]), {})
        for m, cell in row["rows"].items():
            wins = cell["best"] is not None and cell["best"][1] < margin * cell["cublas_us"]
            entries[int(m)] = skinny_gemm.SkinnyConfig(*cell["best"][0]) if wins else None
    return {shape: tuple(sorted(entries.items())) for shape, entries in tuned.items()
            if any(config is not None for config in entries.values())}


def write_skinny_table(tuned: dict, gpu: str) -> None:
    """Replace the TUNED literal in engine/cuda/skinny_gemm.py (between its table markers) by `tuned`."""
    path = Path(__file__).resolve().parents[1] / "engine" / "cuda" / "skinny_gemm.py"
    text = path.read_text()
    begin, end = "# <sweep table>\n", "# </sweep table>\n"
    lines = [begin, f"# {gpu}, benchmarks/gpu_decode_probe.py --skinny, {time.strftime('%Y-%m-%d')}\n",
             "TUNED: dict[tuple[int, int], tuple[tuple[int, SkinnyConfig | None], ...]] = {\n"]
    for (n, k), entries in sorted(tuned.items()):
        lines.append(f"    ({n}, {k}): (\n")
        for m, config in entries:
            value = "None" if config is None else "SkinnyConfig({}, {}, {}, {}, {})".format(*vars_of(config))
            lines.append(f"        ({m}, {value}),\n")
        lines.append("    ),\n")
    lines += ["}\n", end]
    path.write_text(text[:text.index(begin)] + "".join(lines) + text[text.index(end) + len(end):])


def vars_of(config) -> list:
    return [config.block_n, config.block_k, config.num_warps, config.num_stages, config.splits]


def skinny_engine(tuned: dict, model_name: str = "8b") -> None:
    """The engine's decode steps (1, 16, 48, 64 and 80 rows) with cuBLAS beyond one row and with the skinny
    GEMM table, greedy tokens of both compared. No profile: a torch.profiler session followed by a LoRA graph
    capture in the same process ended in a device-side assert (H200, torch 2.11)."""
    from gpu_engine import decode_steps_ms, engine_for, lora_requests, random_prompts, set_overlap
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.cuda import skinny_gemm
    from loraplex.engine.cuda.random_weights import named_config, random_device_model

    config = named_config("Llama-3.1-8B") if model_name == "8b" else ModelConfig.from_hf_dict(SMOLLM2_CONFIG)
    model = random_device_model(config, 2048, device="cuda", dtype=torch.bfloat16)
    engine = engine_for(model, config, num_blocks=80 * 24 + 64, max_num_seqs=80)
    check = random_prompts(18, 64, config.vocab_size, 12)
    RESULT["skinny_engine"] = results = {}
    tokens = {}
    for variant, table in (("cublas", {}), ("skinny", tuned), ("cublas_again", {})):
        skinny_gemm.TUNED.clear()
        skinny_gemm.TUNED.update(table)
        engine.runner.release_graphs()
        row = results[variant] = {}
        tokens[variant] = greedy_tokens(engine, check, 16, overlap=False)
        set_overlap(engine, True)
        for rows in (1, 16, 48, 64, 80):
            got = decode_steps_ms(engine, lora_requests(random_prompts(rows, 180, config.vocab_size, 20 + rows),
                                                        [None], 60), 30)
            row[f"b{rows}_step_ms"], row[f"b{rows}_replay_ms"] = got["step_ms"], got["graph_replay_ms"]
        print(variant, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}, flush=True)
        save()
    pairs = zip(tokens["skinny"], tokens["cublas"], strict=True)
    equal = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
    results["token_match_fraction_skinny_vs_cublas"] = equal / sum(len(x) for x in tokens["cublas"])
    results["tokens_equal_cublas_runs"] = tokens["cublas"] == tokens["cublas_again"]
    print("token match skinny vs cublas", results["token_match_fraction_skinny_vs_cublas"],
          "cublas twice equal", results["tokens_equal_cublas_runs"], flush=True)
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()


def quick_cpu_check() -> None:
    """The probe's kernels against their references through Triton's interpreter (tiny shapes)."""
    import torch.nn.functional as F
    from attention_kernels import relative_error
    from loraplex.engine.cuda.fused_ops import add_rms_norm_, rms_norm_reference, silu_mul, silu_mul_reference
    from loraplex.engine.cuda.gemv import gemv
    from loraplex.engine.cuda.skinny_gemm import SkinnyConfig, skinny_gemm

    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 96, generator=generator), torch.randn(40, 96, generator=generator)
    rows = torch.randn(80, 96, generator=generator)  # 64 rows + a tail of 16, K split in three
    residual, delta = torch.randn(3, 64, generator=generator), torch.randn(3, 64, generator=generator)
    norm_weight = torch.randn(64, generator=generator)
    expected_norm = rms_norm_reference(delta + residual, norm_weight, 1e-5)
    normed, _ = add_rms_norm_(delta, residual, norm_weight, 1e-5)
    gate_up = torch.randn(2, 80, generator=generator)
    errors = {"gemv": relative_error(gemv(x, w, config=(8, 32, 4, 1)), F.linear(x, w)),
              "add_rms_norm": relative_error(normed, expected_norm),
              "silu_mul": relative_error(silu_mul(gate_up), silu_mul_reference(gate_up)),
              "skinny_gemm": relative_error(skinny_gemm(rows, w, config=SkinnyConfig(16, 32, 4, 2, 3)), F.linear(rows, w))}
    if max(errors.values()) > 1e-5:
        raise SystemExit(f"kernel check failed: {errors}")
    print(f"no GPU: the probe's kernels checked through the Triton interpreter {errors}; timings need CUDA")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU: the kernels through the interpreter only")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--lora-only", action="store_true", help="one variant (all fused), then the LoRA runs")
    parser.add_argument("--lora-gemm", action="store_true", help="the one-launch LoRA linear sweep, then --lora-only")
    parser.add_argument("--lora-gemm-shapes", choices=sorted(LORA_GEMM_SHAPES), default="8b",
                        help="whose per-rank shapes --lora-gemm sweeps (70b-tp4: the sweep alone)")
    parser.add_argument("--tp-profile", type=int, default=0, help="only profile a TP engine's b1 step (2 GPUs)")
    parser.add_argument("--skinny", action="store_true",
                        help="only the skinny GEMM sweep (2-128 rows), then the 8B engine's steps with and without it")
    parser.add_argument("--skinny-rows", default="", help="with --skinny: the row counts to sweep (e.g. 80,128)")
    parser.add_argument("--write-table", action="store_true",
                        help="with --skinny: write the updated table into engine/cuda/skinny_gemm.py")
    parser.add_argument("--skip-engine", action="store_true", help="with --skinny: the sweep alone")
    parser.add_argument("--skinny-model", choices=sorted(SKINNY_SHAPES), default="8b",
                        help="with --skinny: whose layer shapes (Llama-3.1-8B's or SmolLM2-135M's)")
    options = parser.parse_args()
    if options.quick or not torch.cuda.is_available():
        quick_cpu_check()
        return
    from attention_kernels import copy_bandwidth_gbps

    RESULT["gpu"] = torch.cuda.get_device_name()
    if options.tp_profile:
        tp_profile(options.tp_profile)
        return
    RESULT["copy_gbps"] = copy_gbps = copy_bandwidth_gbps()
    print(f"card {RESULT['gpu']} copy {copy_gbps:.0f} GB/s", flush=True)
    if options.skinny:
        rows = tuple(int(r) for r in options.skinny_rows.split(",")) if options.skinny_rows else SKINNY_ROWS
        RESULT["skinny"] = skinny_sweep(copy_gbps, rows, options.skinny_model)
        tuned = skinny_table(RESULT["skinny"])
        RESULT["skinny_tuned"] = {str(shape): [(m, c and tuple(vars_of(c))) for m, c in entries]
                                  for shape, entries in tuned.items()}
        print("skinny tuned", RESULT["skinny_tuned"], flush=True)
        save()
        if options.write_table:
            write_skinny_table(tuned, RESULT["gpu"])
        if not options.skip_engine:
            skinny_engine(tuned, options.skinny_model)
            save()
        return
    if options.lora_gemm:
        from loraplex.engine.kernels import lora_gemm

        RESULT["lora_gemm"] = lora_gemm_sweep(copy_gbps, model=options.lora_gemm_shapes)
        save()
        for row in RESULT["lora_gemm"].values():
            n, k = row["n"], row["k"]
            if row["best"] and row["best"][1] < row["cublas_plus_lora_us"]:
                lora_gemm.TUNED[(n, k)] = lora_gemm.LoRAGemmConfig(*row["best"][0])
                lora_gemm.SEPARATE.discard((n, k))
            else:
                lora_gemm.SEPARATE.add((n, k))
        RESULT["lora_gemm_tuned"] = {str(k): str(v) for k, v in lora_gemm.TUNED.items()}
        RESULT["lora_gemm_separate"] = [str(k) for k in lora_gemm.SEPARATE]
        print("lora_gemm tuned", RESULT["lora_gemm_tuned"], "separate", RESULT["lora_gemm_separate"], flush=True)
        if options.lora_gemm_shapes != "8b":  # shard shapes: the TP benchmark measures them in an engine
            save()
            return
        options.lora_only = options.skip_sweep = True
    if not options.skip_sweep:
        RESULT["gemv"] = gemv_sweep(copy_gbps)
        save()
        from loraplex.engine.cuda import gemv as gemv_module

        for (n, k), row in zip(SHAPES.values(), RESULT["gemv"].values(), strict=True):
            if row["best"] and row["best"][1] < row["cublas_us"]:
                gemv_module.TUNED[(n, k)] = tuple(row["best"][0])
        RESULT["tuned"] = {str(k): v for k, v in gemv_module.TUNED.items()}
    engine_variants(copy_gbps, options.lora_only)
    save()
    for name, row in RESULT["variants"].items():
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if "profile" not in k})
    for name, row in RESULT["variants"].items():
        print(f"--- {name} b1 kernels (us/step, launches/step)")
        for r in row["b1_profile"][:14]:
            print("  ", r)
    for mode in [k for k, v in RESULT["lora"].items() if isinstance(v, dict)]:
        print(f"--- lora b64 kernels, {mode}")
        for r in RESULT["lora"].get(mode, {}).get("profile", [])[:8]:
            print("  ", r)


if __name__ == "__main__":
    main()
