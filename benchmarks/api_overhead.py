"""API overhead benchmark (issue 3): the same engine and requests, through HTTP vs in-process.

One run, one machine, one AsyncEngine: the API (`create_app` served by
uvicorn from a thread of this process, as in `loraplex serve`) runs on the
very engine the in-process phase calls directly, so only the API path
differs. The HTTP clients run in a separate process, as real clients do.
Phases alternate over the repeats:

- in-process: 16 concurrent workers call `AsyncEngine.generate` directly;
- HTTP: 16 concurrent `openai.AsyncOpenAI` clients, non-streaming and streaming.

Every request is greedy with `ignore_eos`, so each produces exactly
`max_tokens` tokens; the HTTP outputs are checked equal to the in-process
ones before any timing counts. Then 64 concurrent streams go through HTTP
and every one must end with all its tokens, a finish chunk and `[DONE]`.

Figures: p50 added latency per request (HTTP non-streaming p50 minus
in-process p50), p50 added time per streamed token (inter-token gap, HTTP
streaming minus in-process), errors at 64 concurrent streams.

    python benchmarks/api_overhead.py           # full: writes benchmarks/results/api_overhead.json
    python benchmarks/api_overhead.py --quick   # small sizes, one repeat; writes nothing
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "api_overhead.json"
PROMPTS = [
    "Tell me about the ocean.", "Write a haiku about rain.", "Explain photosynthesis simply.",
    "List three fruits.", "What is a prime number?", "Describe a city at night.",
    "Give advice for a job interview.", "Why is the sky blue?",
]


@dataclass
class Timing:
    latency_s: float
    token_times: list[float] = field(default_factory=list)  # arrival time of each text-bearing output/chunk
    text: str = ""
    num_tokens: int = 0

    @property
    def inter_token_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_tokens - 1)


def p50(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> dict[str, Any]:
    import torch
    import triton

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__, "triton": triton.__version__,
    }


# ---- the two ways of running the same request -----------------------------------------------------

async def inprocess_request(engine: Any, request_id: str, prompt_ids: list[int], max_tokens: int) -> Timing:
    from loraplex.engine.protocol import EngineRequest, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    timing = Timing(0.0)
    parts = []
    async for output in engine.generate(EngineRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling)):
        now = time.perf_counter()
        for delta in output.choices:
            if delta.token_ids:
                timing.token_times.append(now)
            parts.append(delta.text)
            timing.num_tokens = delta.num_output_tokens
    timing.latency_s = time.perf_counter() - start
    timing.text = "".join(parts)
    return timing


async def http_request(client: Any, model: str, prompt: str, max_tokens: int, stream: bool) -> Timing:
    messages = [{"role": "user", "content": prompt}]
    extra = {"ignore_eos": True}
    start = time.perf_counter()
    timing = Timing(0.0)
    if not stream:
        reply = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra
        )
        timing.latency_s = time.perf_counter() - start
        timing.text = reply.choices[0].message.content or ""
        timing.num_tokens = reply.usage.completion_tokens
        return timing
    parts = []
    response = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    )
    finished = False
    async for chunk in response:
        now = time.perf_counter()
        if chunk.usage is not None:
            timing.num_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                timing.token_times.append(now)
                parts.append(choice.delta.content)
            finished = finished or choice.finish_reason is not None
    timing.latency_s = time.perf_counter() - start
    timing.text = "".join(parts)
    if not finished:
        raise RuntimeError("stream ended without a finish chunk")
    return timing


def http_phase(base_url: str, key: str, model: str, num_requests: int, concurrency: int, max_tokens: int,
               stream: bool) -> list[Timing]:
    """One HTTP phase, run in the client process (so the client's own work never competes with the server)."""
    import openai

    async def go() -> list[Timing]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
        try:
            return await run_concurrently(
                lambda i: http_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, stream),
                num_requests, concurrency,
            )
        finally:
            await client.close()

    return asyncio.run(go())


def streams_phase(base_url: str, key: str, model: str, num_streams: int, max_tokens: int) -> int:
    """`num_streams` concurrent streams; how many failed or came back incomplete."""
    import openai

    async def go() -> int:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)

        async def one(i: int) -> bool:
            try:
                t = await http_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, True)
                return t.num_tokens == max_tokens and bool(t.text)
            except Exception:
                return False

        try:
            results = await asyncio.gather(*(one(i) for i in range(num_streams)))
        finally:
            await client.close()
        return sum(not ok for ok in results)

    return asyncio.run(go())


async def run_concurrently(make: Any, num_requests: int, concurrency: int) -> list[Timing]:
    """`concurrency` workers draining `num_requests` jobs; results in job order."""
    results: list[Timing | None] = [None] * num_requests
    jobs: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        jobs.put_nowait(i)

    async def worker() -> None:
        while not jobs.empty():
            i = jobs.get_nowait()
            results[i] = await make(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


# ---- the server ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_settings(data_dir: Path, model_path: Path, max_tokens: int, device: str) -> Any:
    from loraplex.platform.settings import Settings

    return Settings(
        data_dir=data_dir, model_path=model_path, device=device,
        gil_switch_interval_ms=float(os.environ.get("BENCH_SWITCH_MS", "0.5")) or None, kv_cache_memory_mb=512, max_num_seqs=64,
        max_model_len=max(512, 64 + max_tokens), default_rpm=0, default_tpm=0, log_level="warning",
        enable_prefix_caching=False,  # both sides prefill every prompt in full
    )


class ThreadedServer:
    """uvicorn serving `create_app(settings, engine)` from its own thread and event loop."""

    def __init__(self, app: Any, port: int, keep_alive_s: int) -> None:
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=keep_alive_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="bench-uvicorn", daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def create_key(settings: Any) -> str:
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.cli.common import db_session

    with db_session(settings) as db:
        tenant = store.create_tenant(db, name="bench")
        return store.create_api_key(db, tenant=tenant, scopes=[Scope.INFERENCE]).key


# ---- the benchmark ---------------------------------------------------------------------------------

async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from loraplex.platform.app import create_app
    from loraplex.platform.wiring import engine_config

    model_path = args.random_weights or ensure_default_model(ROOT / "data" / "models")
    settings = bench_settings(Path(tempfile.mkdtemp(prefix="api-overhead-")), model_path, args.max_tokens, args.device)
    key = create_key(settings)
    port = free_port()
    if args.random_weights:
        # Same architecture and tokenizer, random weights: where the GGUF cannot travel (the API cost is the same).
        from loraplex.engine.config import ModelConfig
        from transformers import AutoTokenizer

        engine = AsyncEngine.from_random(
            ModelConfig.from_pretrained(model_path), engine_config(settings), AutoTokenizer.from_pretrained(model_path)
        )
    else:
        engine = AsyncEngine.from_model_path(model_path, engine_config(settings))
    server = ThreadedServer(create_app(settings, engine=engine), port, settings.keep_alive_timeout_s).__enter__()
    clients = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    base_url = f"http://127.0.0.1:{port}/v1"
    loop = asyncio.get_running_loop()
    tokenizer = engine.tokenizer
    prompt_ids = [
        tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)["input_ids"]
        for p in PROMPTS
    ]
    n, c, m = args.requests, args.concurrency, args.max_tokens
    counter = iter(range(10**9))
    served = model_path.name

    def inproc(i: int) -> Any:
        return inprocess_request(engine, f"bench-{next(counter)}", prompt_ids[i % len(PROMPTS)], m)

    async def http(num: int, concurrency: int, stream: bool) -> list[Timing]:
        return await loop.run_in_executor(clients, http_phase, base_url, key, served, num, concurrency, m, stream)

    try:
        # Check first: identical greedy outputs both ways, every request exactly max_tokens long. One request
        # at a time, so batch composition (which may move near-tied logits of random weights) is the same.
        reference = await run_concurrently(inproc, len(PROMPTS), 1)
        via_http = await http(len(PROMPTS), 1, False)
        via_stream = await http(len(PROMPTS), 1, True)
        for ref, whole, streamed in zip(reference, via_http, via_stream, strict=True):
            if not (ref.text == whole.text == streamed.text and ref.num_tokens == whole.num_tokens == streamed.num_tokens == m):
                raise SystemExit(f"outputs differ: {ref.text!r} / {whole.text!r} / {streamed.text!r}")

        # Warm up at the timed concurrency (kernel compilation, CUDA graphs, connection pools), untimed.
        await run_concurrently(inproc, c, c)
        await http(c, c, False)
        await http(c, c, True)

        rounds: list[dict[str, float]] = []
        for _ in range(args.repeats):
            inp = await run_concurrently(inproc, n, c)
            whole = await http(n, c, False)
            streamed = await http(n, c, True)
            rounds.append({
                "inprocess_latency_ms": 1000 * p50([t.latency_s for t in inp]),
                "http_latency_ms": 1000 * p50([t.latency_s for t in whole]),
                "http_stream_latency_ms": 1000 * p50([t.latency_s for t in streamed]),
                "inprocess_inter_token_ms": 1000 * p50([t.inter_token_s for t in inp if t.inter_token_s]),
                "http_inter_token_ms": 1000 * p50([t.inter_token_s for t in streamed if t.inter_token_s]),
            })

        # One request at a time: the same engine work both ways, so the difference is the API path alone.
        solo: list[dict[str, float]] = []
        for _ in range(args.repeats):
            inp = await run_concurrently(inproc, len(PROMPTS), 1)
            whole = await http(len(PROMPTS), 1, False)
            streamed = await http(len(PROMPTS), 1, True)
            solo.append({
                "solo_inprocess_latency_ms": 1000 * p50([t.latency_s for t in inp]),
                "solo_http_latency_ms": 1000 * p50([t.latency_s for t in whole]),
                "solo_inprocess_inter_token_ms": 1000 * p50([t.inter_token_s for t in inp if t.inter_token_s]),
                "solo_http_inter_token_ms": 1000 * p50([t.inter_token_s for t in streamed if t.inter_token_s]),
            })

        errors = await loop.run_in_executor(clients, streams_phase, base_url, key, served, 64, args.stream_tokens)
    finally:
        clients.shutdown()
        server.__exit__()
        engine.shutdown()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def solo_med(key: str) -> float:
        return statistics.median(r[key] for r in solo)

    metrics = {
        "p50_added_ms_per_request": med("http_latency_ms") - med("inprocess_latency_ms"),
        "p50_added_ms_per_token": med("http_inter_token_ms") - med("inprocess_inter_token_ms"),
        "errors_at_64_streams": errors,
        "p50_added_ms_per_streamed_request": med("http_stream_latency_ms") - med("inprocess_latency_ms"),
        **{f"p50_{k}": med(k) for k in rounds[0]},
        "p50_added_ms_per_request_one_at_a_time": solo_med("solo_http_latency_ms") - solo_med("solo_inprocess_latency_ms"),
        "p50_added_ms_per_token_one_at_a_time": solo_med("solo_http_inter_token_ms")
        - solo_med("solo_inprocess_inter_token_ms"),
        **{f"p50_{k}": solo_med(k) for k in solo[0]},
        "spread_added_ms_per_request": [r["http_latency_ms"] - r["inprocess_latency_ms"] for r in rounds],
        "spread_added_ms_per_token": [r["http_inter_token_ms"] - r["inprocess_inter_token_ms"] for r in rounds],
    }
    return {
        "benchmark": "api_overhead",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "config": {
            "model": DEFAULT_MODEL_NAME, "weights": "random (same architecture)" if args.random_weights else "GGUF Q4_1, dequantized",
            "dtype": settings.resolve_dtype(), "device": settings.resolve_device(),
            "requests_per_phase": n, "concurrency": c, "max_tokens": m, "repeats": args.repeats,
            "stream_tokens_at_64": args.stream_tokens, "client": "openai.AsyncOpenAI in a separate process",
            "server": "create_app + uvicorn in a thread of the benchmark process, on the same AsyncEngine",
        },
        "metrics": metrics,
        "targets": {
            "p50_added_ms_per_request": {"op": "<=", "value": 5.0},
            "p50_added_ms_per_token": {"op": "<=", "value": 0.5},
            "errors_at_64_streams": {"op": "==", "value": 0},
        },
        "checked": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat, writes nothing")
    parser.add_argument("--device", default="auto", help="engine device: auto, cpu or cuda")
    parser.add_argument("--random-weights", type=Path, default=None, metavar="MODEL_DIR",
                        help="a folder with the model's config.json and tokenizer: random weights instead of the GGUF")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: results/ on full runs)")
    args = parser.parse_args()
    args.requests, args.concurrency, args.max_tokens, args.repeats, args.stream_tokens = (
        (16, 16, 4, 1, 4) if args.quick else (64, 16, 32, 3, 32)
    )
    result = asyncio.run(measure(args))
    for name, value in result["metrics"].items():
        print(f"{name:42s} {value}")
    out = args.out or (None if args.quick else RESULT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
