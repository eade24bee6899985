"""Serving benchmark: open-loop (Poisson) arrivals at a sweep of request rates, through HTTP and into the engine
alone with the same arrival schedule, as vLLM's `benchmark_serving` and SGLang's `bench_serving` measure it.

One run, one machine, one engine configuration both ways:

- HTTP: `loraplex serve` as it runs in production (supervisor, engine-core process, `--api-servers` API server
  processes, SQLite), called by the official `openai.AsyncOpenAI` client spread over `--client-processes`
  processes; each process reports its own CPU share of the phase (`client_cpu_max_fraction`: near 1.0, the
  client would be what sets the pace);
- the engine alone: an `LLMEngine` of the same weights in this process, stepped in a plain loop that adds
  each request at its scheduled arrival (`serving_load.run_engine`).

Requests (deterministic for the seed): random token-id prompts through `/v1/completions`, greedy with
`ignore_eos`; a share on tenants' LoRA adapters (uploaded through `/v1/adapters`; the engine alone serves the
same PEFT folders) and a share constrained by a JSON schema (`response_format`). Two mixes: `fixed` (512 in /
128 out) and `chat` (long-tailed; 15% of outputs 1,000-4,000 tokens). Per mix, the engine's saturation rate is
measured first (every request at once); the sweep runs fractions of it, and `inf` (all at once) both ways.

Also: `long_stream` (64 streams x 1,000 tokens, all at once: HTTP over the engine alone, and the median gap
between tokens early and late in the streams: does the per-token cost grow with the output's length?),
`tiny` (max_tokens=1 requests/s through the API servers, and the engine core's CPU per request).

Outputs are checked before anything is timed: a plain, an adapter and a schema request give the same text
through HTTP as from the engine alone (one at a time, so batch mates cannot move near-tied logits), the
adapter changes the output, and a schema output that finished is valid JSON.

    python benchmarks/serving.py --device cuda --random-weights data/models/SmolLM2-135M-Instruct
    python benchmarks/serving.py --quick     # CPU, small sizes; writes nothing unless --out
    python benchmarks/serving.py ... --model-shape Llama-3.1-8B   # random weights of 8B shapes
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from api_overhead import Clients, Profiler, ServedProcesses, cpu_seconds, create_key, machine
from serving_load import (
    RESPONSE_FORMAT,
    Req,
    Trace,
    chat_mix,
    engine_request,
    fixed_mix,
    http_phase,
    make_requests,
    poisson_offsets,
    position_itl_ms,
    run_engine,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "serving.json"
TARGETS = {
    "long_stream_over_engine_throughput": {"op": ">=", "value": 0.9},
    "ttft_added_ms_p50_at_80pct": {"op": "<=", "value": 5.0},
    "tpot_ratio_p50_at_80pct": {"op": "<=", "value": 1.05},
    "saturation_throughput_ratio": {"op": ">=", "value": 0.95},
    "errors": {"op": "==", "value": 0},
    "tiny_requests_per_s_4_api_servers": {"op": ">=", "value": 2000},
    "engine_core_cpu_ms_per_tiny_request": {"op": "<=", "value": 0.4},
}
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ServingServer(ServedProcesses):
    setting_names = (*ServedProcesses.setting_names, "max_num_batched_tokens", "max_loras", "max_cpu_loras",
                     "max_lora_rank")


def shaped_model_dir(base: Path, shape: str, out: Path) -> Path:
    """A model folder of a named architecture (random weights) with `base`'s tokenizer; the vocabulary is the
    tokenizer's, so every sampled id has text (the HTTP side streams text)."""
    from loraplex.engine.cuda.random_weights import NAMED_CONFIGS

    config = dict(NAMED_CONFIGS[shape])
    base_config = json.loads((base / "config.json").read_text())
    config.update(vocab_size=base_config["vocab_size"], bos_token_id=base_config.get("bos_token_id"),
                  eos_token_id=base_config.get("eos_token_id"), tie_word_embeddings=False,
                  architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_adapters(model_dir: Path, out: Path, num: int, rank: int) -> dict[str, Path]:
    """Random PEFT adapters (rank `rank`, all seven projections), as a tenant's `save_pretrained` writes them."""
    import torch
    from loraplex.adapters.base_model import BaseModelSpec
    from safetensors.torch import save_file

    spec = BaseModelSpec.from_model_dir(model_dir)
    folders = {}
    for a in range(num):
        folder = out / f"adapter-{a}"
        folder.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(1000 + a)
        tensors = {}
        for layer in range(spec.num_layers):
            for module in ADAPTER_TARGETS:
                block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                fan_in, fan_out = spec.module_shapes[module]
                tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) / fan_in**0.5).contiguous()
                # B large enough that the adapter visibly changes greedy output (the check proves it is applied)
                tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.5).contiguous()
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": spec.name, "r": rank,
            "lora_alpha": 2 * rank, "target_modules": list(ADAPTER_TARGETS), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_dora": False, "use_rslora": False, "inference_mode": True,
        }))
        folders[f"bench-adapter-{a}"] = folder
    return folders


def upload_adapters(base_url: str, key: str, folders: dict[str, Path], timeout_s: float = 600) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    ids = []
    for name, folder in folders.items():
        files = [("file", (n, (folder / n).read_bytes(), "application/octet-stream"))
                 for n in ("adapter_config.json", "adapter_model.safetensors")]
        reply = httpx.post(f"{base_url}/adapters", data={"name": name}, files=files, headers=headers, timeout=300)
        if reply.status_code != 202:
            raise SystemExit(f"adapter upload refused: {reply.status_code} {reply.text[:500]}")
        ids.append(reply.json()["id"])
    deadline = time.monotonic() + timeout_s
    for adapter_id in ids:
        while (body := httpx.get(f"{base_url}/adapters/{adapter_id}", headers=headers, timeout=60).json())["status"] == "validating":
            if time.monotonic() > deadline:
                raise SystemExit(f"adapter {adapter_id} still validating after {timeout_s:g} s")
            time.sleep(0.2)
        if body["status"] != "ready":
            raise SystemExit(f"adapter {adapter_id} not ready: {body}")


class Bench:
    """The server, the engine alone and the client processes of one run; each phase runs one side at a time."""

    def __init__(self, args: argparse.Namespace, settings: Any, engine: Any, server: ServingServer, key: str,
                 clients: Clients, make_grammar: Any, model: str) -> None:
        self.args, self.settings, self.engine, self.server, self.key = args, settings, engine, server, key
        self.clients, self.make_grammar, self.model = clients, make_grammar, model
        self.counter = 0
        self.client_cpu: list[float] = []
        self.save: Any = lambda: None  # writes what is measured so far

    def engine_side(self, reqs: list[Req], offsets: list[float]) -> list[Trace]:
        self.counter += 1
        return run_engine(self.engine, reqs, offsets, f"e{self.counter}", self.make_grammar)

    async def http_side(self, reqs: list[Req], offsets: list[float], keep_text: bool = False,
                        base_url: str | None = None) -> list[Trace]:
        """Requests dealt round robin over the client processes; all of them start at one shared instant."""
        loop = asyncio.get_running_loop()
        parts = min(self.clients.num_processes, len(reqs))
        start = time.monotonic() + self.clients.lead_s  # every process has its share before the first arrival
        jobs = [loop.run_in_executor(self.clients.pool, http_phase, base_url or self.server.base_url, self.key,
                                     self.model, reqs[p::parts], [start + o for o in offsets[p::parts]], keep_text)
                for p in range(parts)]
        results = await asyncio.gather(*jobs)
        self.client_cpu.extend(cpu for _, cpu in results)
        traces: list[Trace | None] = [None] * len(reqs)
        for p, (part, _) in enumerate(results):
            traces[p::parts] = part
        return [t for t in traces if t is not None]


def engine_text(engine: Any, req: Req, request_id: str, grammar: Any) -> tuple[str, int, str | None]:
    """One request alone through the engine, its text made as an API server makes it."""
    from loraplex.engine.output.text import RequestText

    request = engine_request(req, request_id, grammar)
    text = RequestText(request, engine.tokenizer)
    engine.add_request(request)
    parts, num, finish = [], 0, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            done = text.process(output)
            for delta in (done.choices if done is not None else []):
                parts.append(delta.text)
                num, finish = delta.num_output_tokens, delta.finish_reason or finish
    return "".join(parts), num, finish


async def check(bench: Bench, reqs: list[Req]) -> dict[str, Any]:
    """The same text both ways for a plain, an adapter and a schema request; the adapter changes the text."""
    picks = [r for r in reqs if r.adapter is None and not r.schema][:1] + [r for r in reqs if r.schema][:1]
    adapted = [r for r in reqs if r.adapter][:1]
    if adapted:  # and its prompt on the base model: the adapter must change the output
        picks += [adapted[0], Req(-1, adapted[0].prompt_ids, adapted[0].max_tokens)]
    texts: dict[int, str] = {}
    for i, req in enumerate(picks):
        ours, num, finish = engine_text(bench.engine, req, f"check-{i}", bench.make_grammar() if req.schema else None)
        [trace] = await bench.http_side([req], [0.0], keep_text=True)
        theirs = "".join(trace.text or [])
        if not trace.ok or theirs != ours or trace.num_tokens != num:
            raise SystemExit(f"check failed for request {req.index} (adapter {req.adapter}, schema {req.schema}): "
                             f"HTTP {trace.error or ''} {theirs[:200]!r} ({trace.num_tokens} tokens) / engine "
                             f"{ours[:200]!r} ({num} tokens)")
        if not req.schema and num != req.max_tokens:
            raise SystemExit(f"request {req.index} produced {num} tokens, not {req.max_tokens}")
        if req.schema and finish == "stop":
            json.loads(ours)  # a schema output that completed is valid JSON
        texts[req.index] = ours
    if adapted and texts[adapted[0].index] == texts[-1]:
        raise SystemExit("the adapter did not change the output: adapters are not applied")
    return {"checked_requests": len(picks)}


def with_prefix(summary: dict[str, Any], side: str, label: str) -> dict[str, Any]:
    return {f"{k}_{side}_{label}": v for k, v in summary.items() if isinstance(v, int | float) or v is None}


async def sweep(bench: Bench, mix: str, reqs: list[Req], fractions: list[float], metrics: dict[str, Any]) -> None:
    """The engine's saturation rate for this mix (all at once), then each fraction of it both ways."""
    args = bench.args
    # Warm-up, untimed, on both sides alike: first uses of a shape (kernel compiles, a graph not captured yet)
    # must not land in either side's figures.
    warm = reqs[: max(len(reqs) // 4, 2)]
    bench.engine_side(warm, [0.0] * len(warm))
    await bench.http_side(warm, [0.0] * len(warm))
    saturated = summarize(bench.engine_side(reqs, [0.0] * len(reqs)))
    # Requests a second the engine completes with everything queued: past this, queues only grow.
    rate_sat = saturated["requests_per_s"]
    metrics[f"saturation_requests_per_s_engine_{mix}"] = rate_sat
    metrics[f"saturation_output_tokens_per_s_engine_{mix}"] = saturated["output_tokens_per_s"]
    bench.save()
    for fraction in fractions:
        label = f"{mix}_inf" if fraction == float("inf") else f"{mix}_{fraction:g}x"
        rate = rate_sat * fraction
        offsets = poisson_offsets(len(reqs), rate, args.seed + 7)
        engine = summarize(bench.engine_side(reqs, offsets))
        http = summarize(await bench.http_side(reqs, offsets))
        metrics[f"rate_per_s_{label}"] = rate
        metrics.update(with_prefix(engine, "engine", label))
        metrics.update(with_prefix(http, "http", label))
        metrics["errors"] += engine["errors"] + http["errors"]
        bench.save()
        for side, s in (("engine", engine), ("http", http)):
            if "first_error" in s:
                metrics.setdefault("first_errors", []).append(f"{side} {label}: {s['first_error']}")
        print(f"{label:14s} rate {rate:8.2f}/s  TTFT p50 {engine['ttft_ms_p50']:8.1f} / {http['ttft_ms_p50']:8.1f} ms"
              f"  TPOT p50 {engine['tpot_ms_p50'] or 0:7.2f} / {http['tpot_ms_p50'] or 0:7.2f} ms"
              f"  tok/s {engine['output_tokens_per_s']:9.0f} / {http['output_tokens_per_s']:9.0f}"
              f"  errors {engine['errors']}/{http['errors']}", flush=True)


async def long_stream(bench: Bench, metrics: dict[str, Any], vocab: int) -> None:
    args = bench.args
    n, length = args.long_streams, args.long_stream_tokens
    reqs = make_requests([(32, length)] * n, vocab, args.seed + 11, [], 0.0, 0.0)
    warm = reqs[: n // 2 or 1]  # warm-up, untimed, both sides
    bench.engine_side(warm, [0.0] * len(warm))
    await bench.http_side(warm, [0.0] * len(warm))
    engine = bench.engine_side(reqs, [0.0] * n)
    profiler = None
    if args.profile_dir is not None:  # py-spy on the core and the API servers through the HTTP streams
        pids = bench.server.children()
        profiler = Profiler(args.profile_dir, "long_stream",
                            {"core": pids[0], **{f"api{i}": pid for i, pid in enumerate(pids[1:])}})
        metrics["long_stream_profiled"] = bool(profiler.processes)
    http = await bench.http_side(reqs, [0.0] * n)
    if profiler is not None:
        profiler.stop()
    se, sh = summarize(engine), summarize(http)
    metrics["long_stream_engine_tokens_per_s"] = se["output_tokens_per_s"]
    metrics["long_stream_http_tokens_per_s"] = sh["output_tokens_per_s"]
    metrics["long_stream_over_engine_throughput"] = sh["output_tokens_per_s"] / max(se["output_tokens_per_s"], 1e-9)
    metrics["long_stream_errors"] = se["errors"] + sh["errors"]
    metrics["errors"] += se["errors"] + sh["errors"]
    tenth = max(length // 10, 1)
    for side, traces in (("engine", engine), ("http", http)):
        metrics[f"long_stream_itl_ms_p50_first_tenth_{side}"] = position_itl_ms(traces, 0, tenth)
        metrics[f"long_stream_itl_ms_p50_last_tenth_{side}"] = position_itl_ms(traces, length - tenth, length)
    for k in ("tpot_ms_p50", "itl_ms_p99", "ttft_ms_p50"):
        metrics[f"long_stream_{k}_engine"], metrics[f"long_stream_{k}_http"] = se[k], sh[k]
    print(f"long streams {n} x {length}: engine {se['output_tokens_per_s']:.0f} tok/s, HTTP "
          f"{sh['output_tokens_per_s']:.0f} tok/s ({metrics['long_stream_over_engine_throughput']:.3f}); gap early/late "
          f"HTTP {metrics['long_stream_itl_ms_p50_first_tenth_http']} / {metrics['long_stream_itl_ms_p50_last_tenth_http']}"
          f" ms, engine {metrics['long_stream_itl_ms_p50_first_tenth_engine']} / "
          f"{metrics['long_stream_itl_ms_p50_last_tenth_engine']} ms", flush=True)


async def tiny(bench: Bench, metrics: dict[str, Any]) -> None:
    pids = bench.server.children()
    before = {pid: cpu_seconds(pid) for pid in pids}
    n = bench.args.tiny_requests
    rate = await bench.clients.tiny(bench.server.base_url, bench.key, bench.model, n, 64)
    spent = {pid: cpu_seconds(pid) - before[pid] for pid in pids}
    num = n + 64  # the warm-up requests count too
    servers = bench.args.api_servers
    metrics[f"tiny_requests_per_s_{servers}_api_servers"] = rate
    metrics["engine_core_cpu_ms_per_tiny_request"] = 1000 * spent[pids[0]] / num
    metrics["api_servers_cpu_ms_per_tiny_request"] = 1000 * sum(spent[p] for p in pids[1:]) / num
    print(f"tiny: {rate:.0f} requests/s through {servers} API servers; engine core "
          f"{metrics['engine_core_cpu_ms_per_tiny_request']:.3f} ms CPU each", flush=True)


def headline(metrics: dict[str, Any], mix: str) -> None:
    label = f"{mix}_0.8x"
    if f"ttft_ms_p50_http_{label}" in metrics:
        metrics["ttft_added_ms_p50_at_80pct" + ("" if mix == "fixed" else f"_{mix}")] = (
            metrics[f"ttft_ms_p50_http_{label}"] - metrics[f"ttft_ms_p50_engine_{label}"])
        metrics["tpot_ratio_p50_at_80pct" + ("" if mix == "fixed" else f"_{mix}")] = (
            metrics[f"tpot_ms_p50_http_{label}"] / metrics[f"tpot_ms_p50_engine_{label}"])
    if f"output_tokens_per_s_http_{mix}_inf" in metrics:
        metrics["saturation_throughput_ratio" + ("" if mix == "fixed" else f"_{mix}")] = (
            metrics[f"output_tokens_per_s_http_{mix}_inf"] / metrics[f"output_tokens_per_s_engine_{mix}_inf"])


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from loraplex.engine.config import AdapterLimits, ModelConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.model.default_model import ensure_default_model
    from loraplex.platform.settings import Settings
    from loraplex.platform.structured import build_structured_output, response_format_spec
    from loraplex.platform.wiring import engine_config
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="serving-"))
    model_path = args.random_weights or ensure_default_model(ROOT / "data" / "models")
    if args.model_shape:
        model_path = shaped_model_dir(model_path, args.model_shape, work / args.model_shape)
    settings = Settings(
        data_dir=work / "data", model_path=model_path, device=args.device, kv_cache_memory_mb=args.kv_cache_mb,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, default_rpm=0, default_tpm=0, log_level="warning",
        enable_prefix_caching=False,  # both sides prefill every prompt in full
        random_weights=args.random_weights is not None, max_pending_requests=100_000,
        gpu_memory_utilization=args.gpu_memory_utilization, max_loras=max(args.adapters, 1),
        max_cpu_loras=max(args.adapters, 1), max_lora_rank=max(args.adapter_rank, 8),
        engine_cpu_threads=args.engine_cpu_threads,
        batch_workers_enabled=not args.quick,  # no batch work is sent: a quick run spares the idle worker's CPU
    )
    threads = settings.resolve_engine_cpu_threads()
    if threads is not None:  # the engine alone runs with the engine core's CPU threads
        import torch

        torch.set_num_threads(threads)
    key = create_key(settings, ("inference", "adapters"))
    server = ServingServer(settings, args.api_servers)
    clients = Clients(args.client_processes, lead_s=0.2 if args.quick else 1.0)
    config = engine_config(settings)
    if settings.random_weights:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        # detokenize off, as in the engine-core process: text is the API servers' work
        engine = LLMEngine.from_random(ModelConfig.from_pretrained(model_path), config, tokenizer, detokenize=False)
    else:
        engine = LLMEngine.from_model_path(model_path, config, detokenize=False)
    folders = write_adapters(model_path, work / "adapters", args.adapters, args.adapter_rank) if args.adapters else {}
    if folders:
        from loraplex.adapters.base_model import BaseModelSpec
        from loraplex.adapters.source import FolderAdapterSource

        engine.serve_adapters(FolderAdapterSource(folders, BaseModelSpec.from_model_dir(model_path), config.torch_dtype),
                              AdapterLimits(max_loras=len(folders), max_cpu_loras=len(folders),
                                            max_lora_rank=max(args.adapter_rank, 8)))
    structured = build_structured_output(engine.tokenizer, engine.model_config.vocab_size)
    spec = response_format_spec(RESPONSE_FORMAT)

    def make_grammar() -> Any:
        return structured.compiler.compile_blocking(spec)

    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    names = list(folders)
    s = args.scale
    mixes = {
        "fixed": make_requests(fixed_mix(args.fixed_requests, *args.fixed_lengths), vocab, args.seed, names,
                               args.adapter_share, args.schema_share),
        "chat": make_requests(chat_mix(args.chat_requests, s, args.seed + 1), vocab, args.seed + 2, names,
                              args.adapter_share, args.schema_share),
    }
    metrics: dict[str, Any] = {"errors": 0}

    def report(partial: bool) -> dict[str, Any]:
        result = {
            "benchmark": "serving",
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine(),
            "config": {
                "model": args.model_shape or "SmolLM2-135M-Instruct",
                "weights": "random (same architecture)" if settings.random_weights else "bundled",
                "vocab_size": engine.model_config.vocab_size, "dtype": settings.resolve_dtype(),
                "device": settings.resolve_device(), "api_servers": args.api_servers,
                "client_processes": args.client_processes, "max_num_seqs": args.max_num_seqs,
                "engine_cpu_threads": settings.resolve_engine_cpu_threads() or "default",
                "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
                "prefix_caching": False, "mixes": {"fixed": f"{args.fixed_requests} x ({args.fixed_lengths[0]} in, {args.fixed_lengths[1]} out)",
                                                   "chat": f"{args.chat_requests} long-tailed (scale {s:g}), 15% 1,000-4,000 out"},
                "adapters": f"{args.adapters} x rank {args.adapter_rank} on all 7 projections, {args.adapter_share:.0%} of requests",
                "json_schema_share": args.schema_share, "fractions_of_engine_saturation": [str(f) for f in args.fractions],
                "chat_fractions": [str(f) for f in args.chat_fractions],
                "long_stream": f"{args.long_streams} x {args.long_stream_tokens} tokens", "tiny_requests": args.tiny_requests,
                "client": "openai.AsyncOpenAI completions streams, requests dealt round robin over the client processes",
                "server": "loraplex serve: supervisor + engine-core process + API servers, SQLite, no Redis; engine "
                          "alone: LLMEngine.step in a plain loop in the benchmark process, requests added at arrival",
            },
            "metrics": metrics,
            "targets": TARGETS,
            "checked": True,
        }
        if partial:
            result["partial"] = True
        return result

    def save_partial() -> None:
        """After each phase: a run cut short (a device lease's time limit) still leaves its figures."""
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report(True), indent=1) + "\n")

    try:
        server.wait_healthy()
        if folders:
            upload_adapters(server.base_url, key, folders)
        bench = Bench(args, settings, engine, server, key, clients, make_grammar, model_path.name)
        bench.save = save_partial
        metrics.update(await check(bench, mixes["fixed"]))
        if "long_stream" in args.phases:
            await long_stream(bench, metrics, vocab)
            save_partial()
        if "tiny" in args.phases:
            await tiny(bench, metrics)
            save_partial()
        for mix in ("fixed", "chat"):
            if mix in args.phases:
                await sweep(bench, mix, mixes[mix], args.fractions if mix == "fixed" else args.chat_fractions, metrics)
                headline(metrics, mix)
                metrics["client_cpu_max_fraction"] = max(bench.client_cpu, default=0.0)
                save_partial()
        metrics["client_cpu_max_fraction"] = max(bench.client_cpu, default=0.0)
        metrics["client_cpu_median_fraction"] = statistics.median(bench.client_cpu) if bench.client_cpu else 0.0
    finally:
        clients.shutdown()
        server.stop()
        engine.close()
    return report(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CPU-sized: small mixes, one fraction; writes nothing")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--random-weights", type=Path, default=None, metavar="MODEL_DIR",
                        help="a folder with the model's config.json and tokenizer: random weights")
    parser.add_argument("--model-shape", default=None, help="random weights of a named architecture (Llama-3.1-8B)")
    parser.add_argument("--api-servers", type=int, default=None)
    parser.add_argument("--client-processes", type=int, default=None)
    parser.add_argument("--phases", default="long_stream,tiny,fixed,chat")
    parser.add_argument("--fractions", default="0.5,0.8,1.0,inf", help="fixed mix: fractions of the saturation rate")
    parser.add_argument("--chat-fractions", default="0.8,inf")
    parser.add_argument("--fixed-requests", type=int, default=None, help="default 512 (quick 8)")
    parser.add_argument("--chat-requests", type=int, default=None, help="default 256 (quick 6)")
    parser.add_argument("--engine-cpu-threads", type=int, default=None,
                        help="LORAPLEX_ENGINE_CPU_THREADS for both engines (default: its own default; quick: 1, "
                             "since OpenMP threads spinning on a busy 2-core machine made CPU steps 15x slower)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="py-spy (if installed) on the server's processes through the HTTP long streams: "
                             "collapsed stacks written here")
    args = parser.parse_args()
    quick = args.quick
    args.api_servers = args.api_servers or (1 if quick else 4)
    args.client_processes = args.client_processes or (1 if quick else 8)
    args.phases = set(args.phases.split(","))
    args.fractions = [float(f) for f in args.fractions.split(",")] if not quick else [0.8, float("inf")]
    args.chat_fractions = [float(f) for f in args.chat_fractions.split(",")] if not quick else [float("inf")]
    fixed_requests, chat_requests = args.fixed_requests, args.chat_requests
    (args.scale, args.fixed_requests, args.chat_requests, args.long_streams, args.long_stream_tokens,
     args.tiny_requests, args.adapters, args.adapter_rank) = (
        (1 / 64, 8, 6, 4, 24, 16, 2, 4) if quick else (1.0, 512, 256, 64, 1000, 2048, 4, 16))
    args.fixed_requests = fixed_requests or args.fixed_requests
    args.chat_requests = chat_requests or args.chat_requests
    args.fixed_lengths = (32, 8) if quick else (512, 128)
    if args.engine_cpu_threads is None:
        args.engine_cpu_threads = 1 if quick else 0
    args.adapter_share, args.schema_share = (0.25, 0.25) if quick else (0.25, 0.1)
    args.max_num_seqs, args.max_model_len, args.max_num_batched_tokens = (
        (8, 512, 256) if quick else (128, 8192, 2048))
    args.kv_cache_mb, args.gpu_memory_utilization = 256, 0.4
    result = asyncio.run(measure(args))
    for name, value in result["metrics"].items():
        print(f"{name:52s} {value}")
    out = args.out or (None if quick else RESULT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
