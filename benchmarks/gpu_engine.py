"""GPU serving path on random Llama-3.1-8B-shaped bf16 weights, each figure against its floor.

In order (partial results are written after every section, to the results file and $OUT):
card copy bandwidth and bf16 GEMM rate; paged decode attention alone (b64, ctx 2k, 32/8 heads);
output check against Hugging Face transformers on the same weights (prefill logits, teacher-
forced greedy decode); decode step at batch 1 and at batch 64 with 1k context; the batch-64
step with 8 and 64 distinct rank-16 adapters on all seven projections; transformers `generate`
(static batches of 32, default attention) and our engine offline on 512 x (512 in, 256 out).

``python benchmarks/gpu_engine.py`` writes benchmarks/results/gpu_engine.json. Without a GPU,
``--quick`` checks the CUDA runner's fused ops through Triton's interpreter and exits.
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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import triton
from attention_kernels import copy_bandwidth_gbps, decode_attention_bandwidth, relative_error, time_eager_us
from loraplex.engine.config import AdapterLimits, EngineConfig, ModelConfig
from loraplex.engine.context import StepContext
from loraplex.engine.cuda.attention import TritonAttentionMetadata, TritonPagedAttention
from loraplex.engine.cuda.fused_ops import rms_norm, rms_norm_reference, rotary_, rotary_reference
from loraplex.engine.cuda.random_weights import (
    NAMED_CONFIGS,
    RandomAdapterSource,
    SyntheticTokenizer,
    named_config,
    random_device_model,
)
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.lora.manager import LoRAManager
from loraplex.engine.protocol import EngineRequest, SamplingParams
from loraplex.engine.step_overlap import StepOverlap

RESULTS = Path(__file__).parent / "results" / "gpu_engine.json"
MODEL = "Llama-3.1-8B"
TARGETS = {
    "decode_b1_fraction_of_roofline": {"op": ">=", "value": 0.85},
    "decode_b64_fraction_of_roofline": {"op": ">=", "value": 0.80},
    "throughput_ratio_vs_transformers": {"op": ">=", "value": 10.0},
    "lora_8_adapters_step_ratio": {"op": "<=", "value": 1.05},
    "attention_bw_fraction": {"op": ">=", "value": 0.70},
}


class Report:
    def __init__(self, path: Path) -> None:
        self.path = path
        props = torch.cuda.get_device_properties(0)
        self.data = {
            "benchmark": "gpu_engine", "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                        "torch": torch.__version__, "triton": triton.__version__},
            "config": {"model": f"{MODEL} shapes, random bf16 weights (std 0.02)", "dtype": "bfloat16",
                       "block_size": 16},
            "metrics": {}, "targets": TARGETS, "checks": {}, "checked": False,
        }

    def add(self, **metrics: object) -> None:
        self.data["metrics"].update(metrics)
        for key, value in metrics.items():
            print(f"  {key} = {value:.4g}" if isinstance(value, float) else f"  {key} = {value}", flush=True)
        self.save()

    def check(self, name: str, ok: bool, detail: object) -> None:
        self.data["checks"][name] = {"ok": bool(ok), "detail": detail}
        self.data["checked"] = all(c["ok"] for c in self.data["checks"].values())
        print(f"  check {name}: {'ok' if ok else 'FAILED'} {detail}", flush=True)
        self.save()

    def save(self) -> None:
        text = json.dumps(self.data, indent=2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(text)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], self.path.name).write_text(text)


def gemm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / time_eager_us(lambda: a @ b) / 1e6


def engine_for(model, config, **overrides) -> LLMEngine:
    settings = {"block_size": 16, "max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 8192,
                "dtype": "bfloat16", "device": "cuda"} | overrides
    return LLMEngine(model, config, EngineConfig(**settings), SyntheticTokenizer(config.vocab_size))


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator).tolist()


def decode_steps_ms(engine: LLMEngine, requests: list[EngineRequest], num_steps: int) -> dict:
    """Run until every request decodes, then time `num_steps` engine steps (host work included)."""
    for request in requests:
        engine.add_request(request)
    deadline = time.monotonic() + 300
    while not (len(engine.scheduler.running) == len(requests)
               and all(len(s.token_ids) > s.num_prompt_tokens for s in engine.scheduler.running)):
        engine.step()
        if time.monotonic() > deadline:
            raise TimeoutError("requests never all reached decode")
    engine.step()
    torch.cuda.synchronize()
    graph_steps = engine.runner.num_graph_steps
    times = []
    with HostSplit(engine) as split:
        for _ in range(num_steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
    graphed = engine.runner.num_graph_steps - graph_steps
    context = statistics.mean(len(s.token_ids) for s in engine.scheduler.running)
    replay_ms = graph_replay_ms(engine, len(requests))
    for request in requests:
        engine.abort(request.request_id)
    return {"step_ms": statistics.median(times), "step_ms_min": min(times), "step_ms_max": max(times),
            "graph_replay_ms": replay_ms, "graphed_steps": graphed, "mean_context": context,
            "host_split_ms": split.medians()}


class HostSplit:
    """Median wall time per step of the engine's parts (schedule, runner execute, output update):
    where the host time between graph replays goes. Wraps the instance's methods while active."""

    PARTS = (("scheduler", "schedule"), ("runner", "execute"), ("runner", "launch"), ("runner", "collect"),
             (None, "apply_step_result"))

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.times: dict[str, list[float]] = {name: [] for _, name in self.PARTS}

    def __enter__(self) -> HostSplit:
        for target, name in self._parts():
            setattr(target, name, self._timed(getattr(target, name), self.times[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for target, name in self._parts():
            delattr(target, name)

    def _parts(self) -> list[tuple[object, str]]:
        """(object, method name) of each part (a runner without `launch`/`collect` runs its steps in `execute`)."""
        parts = []
        for owner, name in self.PARTS:
            target = self.engine if owner is None else getattr(self.engine, owner)
            if callable(getattr(type(target), name, None)):
                parts.append((target, name))
        return parts

    @staticmethod
    def _timed(method, sink: list[float]):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                sink.append((time.perf_counter() - start) * 1e3)
        return timed

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.times.items() if values}


def graph_replay_ms(engine: LLMEngine, batch: int, repeats: int = 20) -> float | None:
    """GPU time of the forward + sample graphs alone (rewrites the same K/V slots: harmless)."""
    graph = engine.runner.last_graph
    if graph is None or graph.batch_size != engine.runner.padded_size(batch):
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.forward.replay()
        graph.sample.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def set_overlap(engine: LLMEngine, on: bool) -> None:
    """Switch overlapped scheduling on the live engine (its in-flight step finished first)."""
    if engine.overlap is not None:
        engine.overlap.drain()
    engine.overlap = StepOverlap(engine) if on else None


def check_overlap(report: Report, engine: LLMEngine, config) -> None:
    """Greedy tokens with overlapped scheduling on equal those with it off: 8 requests decoded
    together, two of them ending 5 steps before the rest (their rows are dropped a step later).
    Prefix caching is off for the check, so both passes prefill the same way (a prefill from the
    cache takes another attention path, and these random bf16 weights have near-tied logits)."""
    prompts = random_prompts(8, 64, config.vocab_size, seed=12)
    engine.block_manager.enable_prefix_caching = False
    runs = []
    for on in (False, True):
        set_overlap(engine, on)
        for i, p in enumerate(prompts):
            sampling = SamplingParams(max_tokens=24 - 5 * (i < 2), temperature=0.0, ignore_eos=True)
            engine.add_request(EngineRequest(f"v{int(on)}_{i}", p, sampling))
        tokens: dict[str, list[int]] = {}
        ahead = engine.overlap.num_steps_ahead if on else 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                key = out.request_id.split("_")[1]
                tokens.setdefault(key, []).extend(t for c in out.choices for t in c.token_ids)
        runs.append(tokens)
    ahead = engine.overlap.num_steps_ahead - ahead
    engine.block_manager.enable_prefix_caching = True
    same = sum(runs[0][k] == runs[1].get(k) for k in runs[0])
    report.check("overlap_greedy_tokens_on_equal_off", same == len(prompts) and ahead > 10,
                 {"requests_equal": same, "requests": len(prompts), "steps_launched_ahead": ahead})


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row per token)."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    if model.lm_head.weight is not model.embed_tokens.weight:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def kv_bytes(config, tokens: float) -> float:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2 * tokens


def hf_twin(model, name: str):
    """A transformers Llama with our model's weights (its default attention)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    raw = dict(NAMED_CONFIGS[name])
    rope = {**raw.pop("rope_scaling"), "rope_theta": raw.pop("rope_theta")}
    raw.pop("model_type")
    hf_config = LlamaConfig(**raw, rope_parameters=rope)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed_tokens.weight)
        hf.model.norm.weight.copy_(model.norm.weight)
        hf.lm_head.weight.copy_(model.lm_head.weight)
        for ours, theirs in zip(model.layers, hf.model.layers, strict=True):
            q, k, v = ours.self_attn.qkv_proj.weight.split(
                [theirs.self_attn.q_proj.out_features, theirs.self_attn.k_proj.out_features,
                 theirs.self_attn.v_proj.out_features])
            theirs.self_attn.q_proj.weight.copy_(q)
            theirs.self_attn.k_proj.weight.copy_(k)
            theirs.self_attn.v_proj.weight.copy_(v)
            theirs.self_attn.o_proj.weight.copy_(ours.self_attn.o_proj.weight)
            gate, up = ours.mlp.gate_up_proj.weight.chunk(2)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(ours.mlp.down_proj.weight)
            theirs.input_layernorm.weight.copy_(ours.input_layernorm.weight)
            theirs.post_attention_layernorm.weight.copy_(ours.post_attention_layernorm.weight)
    return hf


@torch.inference_mode()
def our_prefill_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """One prefill through our model with the Triton backend (a scratch cache), all rows' logits."""
    n = len(ids)
    blocks = -(-n // block_size)
    cfg = model.config
    shape = (blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
    cache = (torch.zeros(shape, device="cuda", dtype=torch.bfloat16), torch.zeros(shape, device="cuda", dtype=torch.bfloat16))
    positions = torch.arange(n, dtype=torch.int32, device="cuda")
    meta = TritonAttentionMetadata(block_size, positions, torch.arange(blocks, dtype=torch.int32, device="cuda")[None],
                                   torch.tensor([n], dtype=torch.int32, device="cuda"),
                                   torch.tensor([0, n], dtype=torch.int32, device="cuda"))
    cos, sin = model.rotary.cos_sin(positions)
    ctx = StepContext(attention=meta, cos=cos, sin=sin, backend=TritonPagedAttention())
    hidden = model(torch.tensor(ids, dtype=torch.int32, device="cuda"), ctx, [cache] * len(model.layers))
    return model.compute_logits(hidden).float()


def check_against_transformers(report: Report, model, hf, config) -> None:
    """Prefill logits against transformers in float32 (its bf16 error is the noise floor), then
    every greedy token of our graph decode path in transformers' teacher-forced top 5."""
    prompt = random_prompts(1, 200, config.vocab_size, seed=5)[0]
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        theirs_bf16 = hf(ids).logits[0].float()
        hf.float()  # in place and back: bf16 -> fp32 -> bf16 is exact
        theirs_fp32 = hf(ids).logits[0].float()
        hf.to(torch.bfloat16)
    ours = our_prefill_logits(model, prompt)
    errors = {"ours_bf16_vs_hf_fp32": relative_error(ours, theirs_fp32),
              "hf_bf16_vs_hf_fp32": relative_error(theirs_bf16, theirs_fp32),
              "ours_bf16_vs_hf_bf16": relative_error(ours, theirs_bf16)}
    ok = errors["ours_bf16_vs_hf_fp32"] < 1.5 * errors["hf_bf16_vs_hf_fp32"] + 1e-3
    report.check("prefill_logits_vs_transformers_fp32", ok, errors)
    engine = engine_for(model, config, num_blocks=512, max_num_seqs=8)
    prompts = random_prompts(4, 64, config.vocab_size, seed=6)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"c{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for c in out.choices for t in c.token_ids)
    in_top5 = total = 0
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            generated = tokens[f"c{i}"]
            logits = hf(torch.tensor([p + generated], device="cuda")).logits[0, len(p) - 1 : -1]
            top5 = logits.topk(5, dim=-1).indices.tolist()
            in_top5 += sum(t in row for t, row in zip(generated, top5, strict=True))
            total += len(generated)
    report.check("greedy_decode_in_transformers_top5", in_top5 >= 0.9 * total,
                 {"in_top5": in_top5, "tokens": total, "graph_steps": engine.runner.num_graph_steps})
    del engine


def run_transformers(report: Report, hf, config, num_batches: int) -> None:
    """Static batches of 32, 512 prompt tokens, exactly 256 new tokens, default attention."""
    prompts = torch.tensor(random_prompts(32, 512, config.vocab_size, seed=7), device="cuda")
    kwargs = {"do_sample": False, "attention_mask": torch.ones_like(prompts), "pad_token_id": 0}
    with torch.inference_mode():
        hf.generate(prompts, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(num_batches):
            out = hf.generate(prompts, max_new_tokens=256, min_new_tokens=256, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    report.check("transformers_output_length", out.shape == (32, 768), list(out.shape))
    tokens = num_batches * 32 * 256
    report.add(transformers_tokens_per_s=tokens / seconds, transformers_batches_run=num_batches,
               transformers_seconds_per_batch=seconds / num_batches,
               transformers_seconds_512_extrapolated=seconds / num_batches * 16,
               transformers_attention=hf.config._attn_implementation)


def run_offline(report: Report, model, config, max_num_seqs: int, max_num_batched_tokens: int,
                suffix: str = "", overlap: bool = True) -> None:
    engine = engine_for(model, config, num_blocks=None, gpu_memory_utilization=0.9, max_num_seqs=max_num_seqs,
                        max_model_len=1024, max_num_batched_tokens=max_num_batched_tokens,
                        overlap_scheduling=overlap)
    report.add(**{f"offline_num_blocks{suffix}": engine.num_blocks,
                  f"offline_config{suffix}": {"max_num_seqs": max_num_seqs,
                                              "max_num_batched_tokens": max_num_batched_tokens}})
    start = time.perf_counter()
    captured = engine.runner.capture_decode_graphs()  # start-up work, as transformers' warm-up is
    report.add(**{f"offline_graphs_captured{suffix}": captured,
                  f"offline_graph_capture_s{suffix}": time.perf_counter() - start})
    prompts = random_prompts(512, 512, config.vocab_size, seed=8)
    sampling = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    counts: dict[str, int] = {}
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"o{i}", p, sampling))
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + sum(len(c.token_ids) for c in out.choices)
    seconds = time.perf_counter() - start
    report.check(f"offline_output_lengths{suffix}", len(counts) == 512 and set(counts.values()) == {256},
                 sorted(set(counts.values())))
    report.add(**{f"ours_tokens_per_s{suffix}": 512 * 256 / seconds, f"ours_offline_seconds{suffix}": seconds,
                  f"ours_graph_steps{suffix}": engine.runner.num_graph_steps,
                  f"ours_eager_steps{suffix}": engine.runner.num_eager_steps,
                  f"ours_preemptions{suffix}": engine.scheduler.num_preemptions})
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def lora_requests(prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> list[EngineRequest]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [EngineRequest(f"l{i}-{adapters[i % len(adapters)]}", p, sampling, adapter_id=adapters[i % len(adapters)])
            for i, p in enumerate(prompts)]


def preload(manager: LoRAManager, adapter_ids: list[str]) -> None:
    """Load adapters before any step: loader threads must not launch CUDA work during a graph capture."""
    for adapter_id in adapter_ids:
        manager.host.request(adapter_id)
    deadline = time.monotonic() + 120
    while not all(a in manager.host for a in adapter_ids):
        if time.monotonic() > deadline:
            raise TimeoutError("adapters did not load")
        time.sleep(0.05)
    torch.cuda.synchronize()


def quick_cpu_check() -> None:
    x, w = torch.randn(3, 48), torch.randn(48)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    angles = torch.rand(5, 1, 16)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_reference(q_ref, k_ref, angles.cos(), angles.sin())
    rotary_(q, k, angles.cos(), angles.sin())
    errors = [relative_error(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)), relative_error(q, q_ref),
              relative_error(k, k_ref)]
    if max(errors) > 1e-5:
        raise SystemExit(f"fused op check failed: {errors}")
    host_split_check()
    print("no GPU: the CUDA runner's fused ops checked through the Triton interpreter, the host-split timer on a "
          "tiny CPU engine; timings need a CUDA device")


def host_split_check() -> None:
    """The timer the GPU run wraps around each step's parts, on a tiny random engine on the CPU: every part it
    names must still exist and be timed (it once wrapped a method renamed since, and failed only on a GPU)."""
    config = ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2})
    engine = LLMEngine.from_random(config, EngineConfig(kv_cache_bytes=4 << 20, max_model_len=256),
                                   SyntheticTokenizer(config.vocab_size))
    for i, prompt in enumerate(random_prompts(3, 12, config.vocab_size, 0)):
        engine.add_request(EngineRequest(f"q{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                                         ignore_eos=True)))
    with HostSplit(engine) as split:
        while engine.has_unfinished_requests():
            engine.step()
    timed = split.medians()
    if not {"schedule", "execute", "apply_step_result"} <= timed.keys():
        raise SystemExit(f"host-split timer lost a part: {sorted(timed)}")


def run_lora_leg(report: Report, engine: LLMEngine, config, prompts64: list[list[int]], weights: int,
                 copy_gbps: float) -> LoRAManager:
    """LoRA at batch 64: 8 adapters over the base step (overlap off, then on), and 64 adapters against their floor."""
    source = RandomAdapterSource(config, rank=16, dtype=torch.bfloat16, device="cuda", std=0.01)
    manager = engine.serve_adapters(source, AdapterLimits(max_loras=64, max_cpu_loras=64, max_lora_rank=16))
    preload(manager, [f"a{i}" for i in range(64)])
    for overlap, suffix in ((False, "_no_overlap"), (True, "")):
        set_overlap(engine, overlap)
        base = decode_steps_ms(engine, lora_requests(prompts64, [None], 40), 20)
        eight = decode_steps_ms(engine, lora_requests(prompts64, [f"a{i}" for i in range(8)], 40), 20)
        report.add(**{f"lora_base_step_ms{suffix}": base["step_ms"], f"lora_8_step_ms{suffix}": eight["step_ms"],
                      f"lora_8_adapters_step_ratio{suffix}": eight["step_ms"] / base["step_ms"],
                      f"lora_8_graph_replay_ratio{suffix}": (eight["graph_replay_ms"] or 0)
                      / (base["graph_replay_ms"] or 1),
                      f"lora_8_host_split_ms{suffix}": eight["host_split_ms"]})
    many = decode_steps_ms(engine, lora_requests(prompts64, [f"a{i}" for i in range(64)], 40), 20)
    floor_64 = (weights + kv_bytes(config, 64 * many["mean_context"]) + 64 * source.num_bytes()) / copy_gbps / 1e6
    report.add(lora_64_step_ms=many["step_ms"], lora_64_floor_ms=floor_64, lora_64_fraction_of_roofline=floor_64 / many["step_ms"],
               lora_64_graph_replay_ms=many["graph_replay_ms"], adapter_bytes=source.num_bytes())
    return manager


def lora_leg_only(options: argparse.Namespace) -> None:
    """Rerun only the LoRA leg into an existing results file: its LoRA metrics are replaced, the rest kept;
    `lora_leg_rerun` names the date and machine of that rerun."""
    report = Report(options.output)
    rerun = {"date": report.data["date"], "machine": report.data["machine"]}
    if options.output.exists():
        report.data = json.loads(options.output.read_text())
    report.data["lora_leg_rerun"] = rerun
    copy_gbps = copy_bandwidth_gbps()
    config = named_config(MODEL)
    model = random_device_model(config, 2048, device="cuda", dtype=torch.bfloat16)
    engine = engine_for(model, config, num_blocks=64 * 72 + 64)
    manager = run_lora_leg(report, engine, config, random_prompts(64, 1024, config.vocab_size, 10),
                           weight_bytes(model), copy_gbps)
    engine.stop_serving_adapters(manager)
    print(json.dumps({k: v for k, v in report.data["metrics"].items() if k.startswith("lora")}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU: interpreter check only")
    parser.add_argument("--hf-batches", type=int, default=2, help="transformers batches of 32 to time (of 16)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--lora-leg", action="store_true", help="only the LoRA leg, into the existing results file")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        quick_cpu_check()
        return
    if options.lora_leg:
        lora_leg_only(options)
        return
    report = Report(options.output)
    print(f"card: {report.data['machine']['gpu']}", flush=True)
    copy_gbps = copy_bandwidth_gbps()
    report.add(copy_bandwidth_gbps=copy_gbps, gemm_bf16_tflops=gemm_tflops())
    attention = decode_attention_bandwidth(copy_gbps)["variants"][0]
    report.add(attention_bw_fraction=attention["bw_fraction"], attention_us=attention["us"])

    config = named_config(MODEL)
    model = random_device_model(config, 2048, device="cuda", dtype=torch.bfloat16)
    weights = weight_bytes(model)
    report.add(weight_bytes=weights, weight_floor_ms=weights / copy_gbps / 1e6)
    hf = hf_twin(model, MODEL)
    check_against_transformers(report, model, hf, config)

    engine = engine_for(model, config, num_blocks=64 * 72 + 64)
    check_overlap(report, engine, config)
    prompts1 = random_prompts(1, 128, config.vocab_size, 9)
    prompts64 = random_prompts(64, 1024, config.vocab_size, 10)
    floor_b1 = weights / copy_gbps / 1e6
    # Every decode figure twice, overlapped scheduling off then on (the headline keys: on)
    for overlap, suffix in ((False, "_no_overlap"), (True, "")):
        set_overlap(engine, overlap)
        b1 = decode_steps_ms(engine, lora_requests(prompts1, [None], 100), 60)
        report.add(**{f"decode_b1_step_ms{suffix}": b1["step_ms"],
                      f"decode_b1_graph_replay_ms{suffix}": b1["graph_replay_ms"],
                      f"decode_b1_tokens_per_s{suffix}": 1e3 / b1["step_ms"], "decode_b1_floor_ms": floor_b1,
                      f"decode_b1_fraction_of_roofline{suffix}": floor_b1 / b1["step_ms"],
                      f"decode_b1_detail{suffix}": b1})
        b64 = decode_steps_ms(engine, lora_requests(prompts64, [None], 40), 20)
        floor_b64 = (weights + kv_bytes(config, 64 * b64["mean_context"])) / copy_gbps / 1e6
        report.add(**{f"decode_b64_step_ms{suffix}": b64["step_ms"],
                      f"decode_b64_graph_replay_ms{suffix}": b64["graph_replay_ms"], "decode_b64_floor_ms": floor_b64,
                      f"decode_b64_fraction_of_roofline{suffix}": floor_b64 / b64["step_ms"],
                      f"decode_b64_detail{suffix}": b64})

    manager = run_lora_leg(report, engine, config, prompts64, weights, copy_gbps)
    engine.stop_serving_adapters(manager)
    del engine, manager
    gc.collect()

    run_transformers(report, hf, config, options.hf_batches)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    # The headline: every request admitted at once (max_num_seqs 512, 16k-token steps), overlapped
    # scheduling on; then the same with it off.
    run_offline(report, model, config, 512, 16384)
    metrics = report.data["metrics"]
    report.add(throughput_ratio_vs_transformers=metrics["ours_tokens_per_s"] / metrics["transformers_tokens_per_s"])
    run_offline(report, model, config, 512, 16384, suffix="_no_overlap", overlap=False)
    report.add(throughput_ratio_vs_transformers_no_overlap=metrics["ours_tokens_per_s_no_overlap"]
               / metrics["transformers_tokens_per_s"])
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
