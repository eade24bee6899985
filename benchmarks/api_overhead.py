"""API overhead benchmark: the same engine and requests, through `loraplex serve` over HTTP vs in-process.

One run, one machine, the same engine settings both ways:

- in-process: the engine alone, `LLMEngine.step` in a plain loop in this
  process (`engine_alone`), closed-loop like the clients: the baseline the
  added figures are measured from. Nothing else runs in the process then, so
  its steps are as fast as the engine-core process's. An `AsyncEngine` on the
  same engine (its loop thread sharing the GIL with the benchmark's consumer
  coroutines, which slowed its steps below the engine core's and once made
  the added time per token negative) is still timed, and reported beside it
  (`..._vs_async_engine_...`);
- HTTP: `loraplex serve` as it runs in production (a supervisor, the
  engine-core process, API server processes), called by `openai.AsyncOpenAI`
  clients, non-streaming and streaming. The clients are spread over several
  client processes (`--client-processes`, 8 by default): one Python process
  holding 64 official streaming clients tops out near 3,700 SSE chunks/s
  (pydantic-parsing each chunk), below what the engine decodes at 64 streams,
  so one client process would measure itself, not the server.

Only one side works at a time (phases alternate over the repeats), so they
never compete for the machine. Every request is greedy with `ignore_eos`, so
each produces exactly `max_tokens` tokens; the HTTP outputs are checked
equal to the in-process ones before any timing counts, and every stream must
end with all its tokens and a finish chunk.

Figures, at 16 and at 64 concurrent requests: p50 added latency per request
(HTTP non-streaming p50 minus the engine alone's p50), p50 added time per
streamed token (HTTP streaming's gap per chunk, never less than its gap per
token, minus the engine alone's gap per token),
decode throughput of HTTP streams over the engine alone at 64, errors at 64
streams; the 64 streams' throughput and added time per chunk again through 2
and 4 API server processes on one engine core (the layout `serve` defaults to
where Redis is configured); requests/s for tiny requests (max_tokens 1) with
1, 2 and 4 API server processes, and the CPU milliseconds each request cost the engine
core and the API servers meanwhile; the API servers' CPU microseconds per
streamed chunk at the largest concurrency (what bounds how many streams one
API server keeps up with, whatever the engine's speed). `--profile-dir` runs the tiny and
streaming phases once more under py-spy, after everything is timed.

    python benchmarks/api_overhead.py           # full: writes benchmarks/results/api_overhead.json
    python benchmarks/api_overhead.py --quick   # small sizes, one repeat; writes nothing
    python benchmarks/api_overhead.py --device cuda --random-weights data/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is loaded
from serve_health import wait_healthy

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
    token_ids: list[int] = field(default_factory=list)

    @property
    def inter_token_s(self) -> float | None:
        """Time per output token after the first (TPOT): a server that is behind sends several tokens per chunk
        (as vLLM's stream interval does), so chunks are not counted, tokens are."""
        if not self.token_times or self.num_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_tokens - 1)

    @property
    def inter_chunk_s(self) -> float | None:
        """Time per output after the first: per token for the engine alone (one output per step); for an HTTP
        stream, per chunk, which is never less than per token. Dividing by tokens instead (inter_token_s) comes
        out too low when the first chunk carries several tokens (the server was busy as the stream started):
        that made the added time per token negative. This one can only overstate it."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


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
                timing.token_ids += delta.token_ids
            parts.append(delta.text)
            timing.num_tokens = delta.num_output_tokens
    timing.latency_s = time.perf_counter() - start
    timing.text = "".join(parts)
    return timing


class SharedEngine:
    """The AsyncEngine's view of the LLMEngine: its loop thread steps only while `engine_alone` does not.

    Both sides use one engine (one copy of the weights and KV cache on the card); `engine_alone` holds the
    lock for its whole run, so the AsyncEngine's thread, if it wakes, waits (off the GIL) until it is over.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def step(self) -> Any:
        with self.lock:
            return self.engine.step()

    def has_unfinished_requests(self) -> bool:
        with self.lock:
            return self.engine.has_unfinished_requests()

    def stats(self) -> Any:
        with self.lock:
            return self.engine.stats()


def engine_alone(shared: SharedEngine, prompt_ids: list[list[int]], num_requests: int, concurrency: int, max_tokens: int,
                 prefix: str) -> tuple[list[Timing], float]:
    """The engine by itself: `LLMEngine.step` in a plain loop in this thread, as the engine-core process runs it,
    with nothing else in the process taking the GIL (no event loop, no consumers, no text made).

    Closed loop, like the HTTP clients: `concurrency` requests run; each one that finishes is replaced by the
    next before the next step. Returns the timings (in request order) and the wall time of the whole run.
    The AsyncEngine built on the same LLMEngine does not step meanwhile (`SharedEngine`).
    """

    with shared.lock:
        return _engine_alone(shared.engine, prompt_ids, num_requests, concurrency, max_tokens, prefix)


def _engine_alone(engine: Any, prompt_ids: list[list[int]], num_requests: int, concurrency: int, max_tokens: int,
                  prefix: str) -> tuple[list[Timing], float]:
    from loraplex.engine.protocol import EngineRequest, SamplingParams

    results: list[Timing | None] = [None] * num_requests
    running: dict[str, tuple[int, Timing, float]] = {}
    next_index = 0

    def add() -> None:
        nonlocal next_index
        i, next_index = next_index, next_index + 1
        request_id = f"{prefix}-{i}"
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        running[request_id] = (i, Timing(0.0), time.perf_counter())
        engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt_ids[i % len(prompt_ids)],
                                         sampling=sampling))

    start = time.perf_counter()
    for _ in range(min(concurrency, num_requests)):
        add()
    while running:
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            i, timing, started = running[output.request_id]
            for delta in output.choices:
                if delta.token_ids:
                    timing.token_times.append(now)
                    timing.token_ids += delta.token_ids
                timing.num_tokens = delta.num_output_tokens
            if output.finished:
                timing.latency_s = now - started
                results[i] = timing
                del running[output.request_id]
                if next_index < num_requests:
                    add()
    return [r for r in results if r is not None], time.perf_counter() - start


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


def http_phase(base_url: str, key: str, model: str, first: int, num_requests: int, concurrency: int,
               max_tokens: int, stream: bool, start_at: float) -> list[Timing]:
    """One client process's share of an HTTP phase (requests `first`... of the phase), started at `start_at`."""
    import openai

    async def go() -> list[Timing]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
        await asyncio.sleep(max(start_at - time.monotonic(), 0.0))
        try:
            return await run_concurrently(
                lambda i: http_request(client, model, PROMPTS[(first + i) % len(PROMPTS)], max_tokens, stream),
                num_requests, concurrency,
            )
        finally:
            await client.close()

    return asyncio.run(go())


def streams_phase(base_url: str, key: str, model: str, first: int, num_streams: int, max_tokens: int,
                  start_at: float) -> tuple[int, float, float, list[Timing]]:
    """One client process's `num_streams` concurrent streams, started at `start_at` (time.monotonic, shared by
    every process on the machine): (how many failed or came back incomplete, start, end, timings)."""
    import openai

    async def go() -> tuple[int, float, float, list[Timing]]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)

        async def one(i: int) -> Timing | None:
            try:
                t = await http_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, True)
            except Exception:
                return None
            return t if t.num_tokens == max_tokens and t.text else None

        await asyncio.sleep(max(start_at - time.monotonic(), 0.0))
        start = time.monotonic()
        try:
            results = await asyncio.gather(*(one(first + i) for i in range(num_streams)))
        finally:
            await client.close()
        return sum(r is None for r in results), start, time.monotonic(), [r for r in results if r is not None]

    return asyncio.run(go())


def tiny_phase(base_url: str, key: str, model: str, num_requests: int, concurrency: int, start_at: float
               ) -> tuple[float, float]:
    """One client process's share of max_tokens=1 requests (what the API servers, not the engine, can take):
    (start, end) of its timed part, started at `start_at`."""
    import openai

    async def go() -> tuple[float, float]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)

        async def one(i: int) -> Timing:
            reply = await client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=1)
            if reply.usage.completion_tokens != 1:
                raise RuntimeError("a tiny request did not produce its token")
            return Timing(0.0)

        try:
            await run_concurrently(one, concurrency, concurrency)  # warm the connection pool
            await asyncio.sleep(max(start_at - time.monotonic(), 0.0))
            start = time.monotonic()
            await run_concurrently(one, num_requests, concurrency)
            return start, time.monotonic()
        finally:
            await client.close()

    return asyncio.run(go())


def import_openai() -> None:
    """Client processes import the SDK once, before any phase is timed."""
    import openai  # noqa: F401


class Clients:
    """`num_processes` client processes; each phase splits its requests and concurrency between them.

    A phase starts `lead_s` (x0.5 plain requests, x2 tiny ones: their warm-up comes first) after it is handed
    out, so every process has its share before the first request; a quick run's few requests need less.
    """

    def __init__(self, num_processes: int, lead_s: float = 1.0) -> None:
        self.num_processes, self.lead_s = num_processes, lead_s
        self.pool = ProcessPoolExecutor(max_workers=num_processes, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=import_openai)
        for future in [self.pool.submit(time.sleep, 0.5) for _ in range(num_processes)]:
            future.result()  # every process started (and imported openai) before anything is timed

    def shares(self, total: int, num_parts: int | None = None) -> list[int]:
        """`total` split as evenly as possible over `num_parts` processes (all by default), empty shares dropped."""
        num_parts = num_parts or self.num_processes
        base, extra = divmod(total, num_parts)
        return [n for n in (base + (i < extra) for i in range(num_parts)) if n]

    async def http(self, base_url: str, key: str, model: str, num_requests: int, concurrency: int,
                   max_tokens: int, stream: bool) -> list[Timing]:
        """Timings in request order when one process does it all (concurrency 1: the output check)."""
        loop = asyncio.get_running_loop()
        num_parts = min(self.num_processes, concurrency)
        shares = self.shares(num_requests, num_parts)
        firsts = [sum(shares[:i]) for i in range(len(shares))]
        start_at = time.monotonic() + 0.5 * self.lead_s
        jobs = [loop.run_in_executor(self.pool, http_phase, base_url, key, model, first, n, c, max_tokens, stream,
                                     start_at)
                for first, n, c in zip(firsts, shares, self.shares(concurrency, num_parts), strict=True)]
        return [t for part in await asyncio.gather(*jobs) for t in part]

    async def streams(self, base_url: str, key: str, model: str, num_streams: int, max_tokens: int
                      ) -> tuple[int, float, list[Timing]]:
        """(failed, wall seconds from the first start to the last end, timings) for `num_streams` streams."""
        loop = asyncio.get_running_loop()
        start_at = time.monotonic() + self.lead_s
        shares = self.shares(num_streams)
        firsts = [sum(shares[:i]) for i in range(len(shares))]
        parts = await asyncio.gather(*(
            loop.run_in_executor(self.pool, streams_phase, base_url, key, model, first, n, max_tokens, start_at)
            for first, n in zip(firsts, shares, strict=True)))
        wall = max(p[2] for p in parts) - min(p[1] for p in parts)
        return sum(p[0] for p in parts), wall, [t for p in parts for t in p[3]]

    async def tiny(self, base_url: str, key: str, model: str, num_requests: int, concurrency: int) -> float:
        loop = asyncio.get_running_loop()
        start_at = time.monotonic() + 2 * self.lead_s
        parts = await asyncio.gather(*(
            loop.run_in_executor(self.pool, tiny_phase, base_url, key, model, n, c, start_at)
            for n, c in zip(self.shares(num_requests), self.shares(concurrency), strict=False)))
        return num_requests / (max(p[1] for p in parts) - min(p[0] for p in parts))

    def shutdown(self) -> None:
        self.pool.shutdown()


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


# ---- the server: `loraplex serve` as a subprocess -----------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_settings(data_dir: Path, model_path: Path, max_tokens: int, device: str, random_weights: bool,
                   engine_cpu_threads: int = 0, batch_workers: bool = True) -> Any:
    from loraplex.platform.settings import Settings

    return Settings(
        data_dir=data_dir, model_path=model_path, device=device, kv_cache_memory_mb=512, max_num_seqs=64,
        max_model_len=max(512, 64 + max_tokens), default_rpm=0, default_tpm=0, log_level="warning",
        enable_prefix_caching=False,  # both sides prefill every prompt in full
        random_weights=random_weights, max_pending_requests=4096, engine_cpu_threads=engine_cpu_threads,
        gpu_memory_utilization=0.2,  # four engines share one GPU: in-process, 1, 2 and 4 API servers
        batch_workers_enabled=batch_workers,
    )


def die_with_parent() -> None:
    from loraplex.engine.process_lifetime import die_with_parent as request_sigterm_on_parent_death

    request_sigterm_on_parent_death()


class ServedProcesses:
    """`loraplex serve --api-servers N` in its own process group, on `settings`' data and model."""

    # The settings passed to the server (as LORAPLEX_ variables); other benchmarks add their own.
    setting_names: tuple[str, ...] = (
        "data_dir", "model_path", "device", "kv_cache_memory_mb", "max_num_seqs", "max_model_len", "default_rpm",
        "default_tpm", "log_level", "enable_prefix_caching", "random_weights", "max_pending_requests",
        "gpu_memory_utilization", "engine_cpu_threads", "batch_workers_enabled",
    )

    def __init__(self, settings: Any, api_servers: int) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        for name in self.setting_names:
            env[f"LORAPLEX_{name.upper()}"] = str(getattr(settings, name))
        self.log = open(Path(settings.data_dir) / f"serve-{api_servers}.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "loraplex.platform.cli.main", "serve", "--port", str(self.port),
             "--api-servers", str(api_servers)],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent,  # a benchmark killed mid-run leaves no server behind
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def children(self) -> list[int]:
        """The supervisor's processes in start order: the engine core, then the API servers."""
        pid = self.process.pid
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        kids = [k for k in kids if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]
        return sorted(kids, key=lambda k: int(Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[19]))

    def wait_healthy(self, timeout_s: float = 900) -> None:
        wait_healthy(f"http://127.0.0.1:{self.port}/healthz", self.process, Path(self.log.name), timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.log.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Profiler:
    """py-spy recording the given processes (raw collapsed stacks, for diagnosis only) until stopped."""

    def __init__(self, out_dir: Path, label: str, pids: dict[str, int]) -> None:
        import shutil

        binary = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        out_dir.mkdir(parents=True, exist_ok=True)
        self.processes = [
            subprocess.Popen([binary, "record", "--nonblocking", "--threads", "-r", "200", "-f", "raw",
                              "-p", str(pid), "-o", str(out_dir / f"{label}-{role}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for role, pid in pids.items()
        ] if Path(binary).exists() else []
        time.sleep(1.0 if self.processes else 0.0)  # attached before the load starts

    def stop(self) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGINT)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def create_key(settings: Any, scopes: tuple[str, ...] = ("inference",)) -> str:
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.cli.common import db_session
    from loraplex.platform.db.migrate import prepare_database

    prepare_database(settings)
    with db_session(settings) as db:
        tenant = store.create_tenant(db, name="bench")
        return store.create_api_key(db, tenant=tenant, scopes=[Scope(s) for s in scopes]).key


# ---- the benchmark ---------------------------------------------------------------------------------

async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from loraplex.platform.wiring import engine_config

    model_path = args.random_weights or ensure_default_model(ROOT / "data" / "models")
    settings = bench_settings(Path(tempfile.mkdtemp(prefix="api-overhead-")), model_path, args.max_tokens,
                              args.device, random_weights=args.random_weights is not None,
                              engine_cpu_threads=args.engine_cpu_threads, batch_workers=not args.quick)
    if args.quick:  # the engine alone runs with the engine core's one CPU thread
        import torch

        torch.set_num_threads(args.engine_cpu_threads)
    key = create_key(settings)
    servers = {n: ServedProcesses(settings, n) for n in args.api_servers}
    if args.random_weights:
        # Same architecture and tokenizer, random weights (seed 0 both sides): where the GGUF cannot travel.
        from loraplex.engine.config import ModelConfig
        from transformers import AutoTokenizer

        llm = LLMEngine.from_random(ModelConfig.from_pretrained(model_path), engine_config(settings),
                                    AutoTokenizer.from_pretrained(model_path), detokenize=False)
    else:
        llm = LLMEngine.from_model_path(model_path, engine_config(settings), detokenize=False)
    shared = SharedEngine(llm)
    engine = AsyncEngine(shared)  # type: ignore[arg-type]  # its core's thread steps through the lock engine_alone holds
    for server in servers.values():
        server.wait_healthy()
    clients = Clients(args.client_processes, lead_s=0.2 if args.quick else 1.0)
    base_url = servers[args.api_servers[0]].base_url
    tokenizer = engine.tokenizer
    prompt_ids = [
        tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)["input_ids"]
        for p in PROMPTS
    ]
    m = args.max_tokens
    counter = iter(range(10**9))
    served = model_path.name

    def inproc(i: int, max_tokens: int = m) -> Any:
        return inprocess_request(engine, f"bench-{next(counter)}", prompt_ids[i % len(PROMPTS)], max_tokens)

    async def http(num: int, concurrency: int, stream: bool) -> list[Timing]:
        return await clients.http(base_url, key, served, num, concurrency, m, stream)

    try:
        # Check first: identical greedy outputs both ways, every request exactly max_tokens long. One request
        # at a time, so batch composition (which may move near-tied logits) is the same.
        reference = await run_concurrently(inproc, len(PROMPTS), 1)
        alone_check, _ = engine_alone(shared, prompt_ids, len(PROMPTS), 1, m, "check")
        for ref, bare in zip(reference, alone_check, strict=True):
            if ref.token_ids != bare.token_ids or bare.num_tokens != m:
                raise SystemExit(f"the engine alone differs from the AsyncEngine: {bare.token_ids} / {ref.token_ids}")
        via_http = await http(len(PROMPTS), 1, False)
        via_stream = await http(len(PROMPTS), 1, True)
        for ref, whole, streamed in zip(reference, via_http, via_stream, strict=True):
            if not (ref.text == whole.text == streamed.text and ref.num_tokens == whole.num_tokens == streamed.num_tokens == m):
                raise SystemExit(f"outputs differ: {ref.text!r} / {whole.text!r} / {streamed.text!r}")

        metrics: dict[str, Any] = {}
        for c in args.concurrencies:
            n = c * args.requests_per_worker
            await run_concurrently(inproc, c, c)  # warm-up at this concurrency, untimed
            engine_alone(shared, prompt_ids, c, c, m, f"warm-{c}")
            await http(c, c, False)
            await http(c, c, True)
            rounds: list[dict[str, float]] = []
            for r in range(args.repeats):
                alone, _ = engine_alone(shared, prompt_ids, n, c, m, f"alone-{c}-{r}")
                inp = await run_concurrently(inproc, n, c)
                whole = await http(n, c, False)
                streamed = await http(n, c, True)
                rounds.append({
                    "engine_latency_ms": 1000 * p50([t.latency_s for t in alone]),
                    "engine_inter_token_ms": 1000 * p50([t.inter_token_s for t in alone if t.inter_token_s is not None]),
                    "http_inter_chunk_ms": 1000 * p50([t.inter_chunk_s for t in streamed if t.inter_chunk_s is not None]),
                    "inprocess_latency_ms": 1000 * p50([t.latency_s for t in inp]),
                    "http_latency_ms": 1000 * p50([t.latency_s for t in whole]),
                    "inprocess_inter_token_ms": 1000 * p50([t.inter_token_s for t in inp if t.inter_token_s is not None]),
                    "http_inter_token_ms": 1000 * p50([t.inter_token_s for t in streamed if t.inter_token_s is not None]),
                })

            def med(name: str, rounds: list[dict[str, float]] = rounds) -> float:
                return statistics.median(r[name] for r in rounds)

            # Added = HTTP minus the engine alone. The AsyncEngine figures (the engine thread sharing this
            # process's GIL with its consumers, which slows its steps) are kept beside them for comparison.
            metrics[f"p50_added_ms_per_request_{c}"] = med("http_latency_ms") - med("engine_latency_ms")
            # Per token: the stream's gap per chunk (an upper bound of its gap per token) over the engine's per
            # step; the tokens-based figure (biased low, see Timing.inter_chunk_s) is kept beside it.
            metrics[f"p50_added_ms_per_token_{c}"] = med("http_inter_chunk_ms") - med("engine_inter_token_ms")
            metrics[f"p50_added_ms_per_token_tokens_based_{c}"] = (med("http_inter_token_ms")
                                                                   - med("engine_inter_token_ms"))
            metrics[f"p50_added_ms_per_request_vs_async_engine_{c}"] = med("http_latency_ms") - med("inprocess_latency_ms")
            metrics[f"p50_added_ms_per_token_vs_async_engine_{c}"] = (med("http_inter_token_ms")
                                                                      - med("inprocess_inter_token_ms"))
            metrics.update({f"p50_{k}_{c}": med(k) for k in rounds[0]})
            metrics[f"spread_added_ms_per_request_{c}"] = [r["http_latency_ms"] - r["engine_latency_ms"] for r in rounds]
            metrics[f"spread_added_ms_per_token_{c}"] = [r["http_inter_chunk_ms"] - r["engine_inter_token_ms"]
                                                        for r in rounds]

        # Decode throughput at the largest concurrency (64), each side alone on the machine.
        ratios, async_ratios, errors, s = [], [], 0, max(args.concurrencies)
        api_pids = servers[args.api_servers[0]].children()[1:]
        for r in range(args.repeats):
            alone, alone_wall = engine_alone(shared, prompt_ids, s, s, args.stream_tokens, f"tps-{r}")
            engine_tps = sum(t.num_tokens for t in alone) / alone_wall
            start = time.perf_counter()
            inp = await asyncio.gather(*(inproc(i, args.stream_tokens) for i in range(s)))
            inprocess_tps = sum(t.num_tokens for t in inp) / (time.perf_counter() - start)
            api_cpu_before = sum(cpu_seconds(pid) for pid in api_pids)
            failed, wall, streams = await clients.streams(base_url, key, served, s, args.stream_tokens)
            api_cpu = sum(cpu_seconds(pid) for pid in api_pids) - api_cpu_before
            errors += failed
            # The API servers' CPU per content chunk its clients received (requests' own costs included): what
            # bounds the chunks one API server can stream, whatever the engine's speed (CPU time, not wall).
            num_chunks = sum(len(t.token_times) for t in streams)
            metrics.setdefault(f"stream_cpu_us_per_chunk_api_servers_{s}", []).append(1e6 * api_cpu / max(num_chunks, 1))
            http_tps = sum(t.num_tokens for t in streams) / wall
            ratios.append(http_tps / engine_tps)
            async_ratios.append(http_tps / inprocess_tps)
            metrics.setdefault(f"engine_decode_tokens_per_s_{s}", []).append(engine_tps)
            metrics.setdefault(f"inprocess_decode_tokens_per_s_{s}", []).append(inprocess_tps)
            metrics.setdefault(f"http_decode_tokens_per_s_{s}", []).append(http_tps)
            engine_gap_ms = 1000 * p50([t.inter_token_s for t in alone if t.inter_token_s is not None])
            # The same streams through several API servers on one engine core (the layout `serve` defaults to
            # where Redis shares sessions and limits): each server turns only its share of the chunks into SSE.
            for n in args.api_servers[1:]:
                failed, wall, streams = await clients.streams(servers[n].base_url, key, served, s, args.stream_tokens)
                errors += failed
                many = metrics.setdefault(f"api_servers_{n}", {"ratios": [], "added_ms_per_chunk": []})
                many["ratios"].append(sum(t.num_tokens for t in streams) / wall / engine_tps)
                gap_ms = 1000 * p50([t.inter_chunk_s for t in streams if t.inter_chunk_s is not None])
                many["added_ms_per_chunk"].append(gap_ms - engine_gap_ms)
        # "in-process" is the engine alone (see engine_alone); the AsyncEngine ratio is kept beside it.
        metrics[f"http_over_inprocess_throughput_{s}"] = statistics.median(ratios)
        for n in args.api_servers[1:]:
            many = metrics.pop(f"api_servers_{n}")
            metrics[f"http_over_inprocess_throughput_{s}_api_servers_{n}"] = statistics.median(many["ratios"])
            metrics[f"p50_added_ms_per_token_{s}_api_servers_{n}"] = statistics.median(many["added_ms_per_chunk"])
            metrics[f"spread_http_over_inprocess_throughput_{s}_api_servers_{n}"] = many["ratios"]
        metrics[f"http_over_async_engine_throughput_{s}"] = statistics.median(async_ratios)
        metrics[f"errors_at_{s}_streams"] = errors

        for n, server in servers.items():
            pids = server.children()
            before = {pid: cpu_seconds(pid) for pid in pids}
            metrics[f"tiny_requests_per_s_{n}_api_server{'s' if n > 1 else ''}"] = await clients.tiny(
                server.base_url, key, served, args.tiny_requests, 64)
            # Where the CPU goes (warm-up requests included: 64 more): is an API server the bottleneck?
            spent = {pid: cpu_seconds(pid) - before[pid] for pid in pids}
            num = args.tiny_requests + 64
            metrics[f"tiny_cpu_ms_per_request_engine_core_{n}"] = 1000 * spent[pids[0]] / num
            metrics[f"tiny_cpu_ms_per_request_api_servers_{n}"] = 1000 * sum(spent[p] for p in pids[1:]) / num

        if args.profile_dir is not None:
            # Untimed: the same tiny requests and 64 streams again, with py-spy on each process of one server.
            server = servers[args.api_servers[0]]
            pids = server.children()
            roles = {"core": pids[0], **{f"api{i}": pid for i, pid in enumerate(pids[1:])}}
            profiler = Profiler(args.profile_dir, "tiny", roles)
            await clients.tiny(server.base_url, key, served, args.tiny_requests, 64)
            profiler.stop()
            profiler = Profiler(args.profile_dir, "streams", roles)
            await clients.streams(server.base_url, key, served, s, args.stream_tokens)
            profiler.stop()
    finally:
        clients.shutdown()
        for server in servers.values():
            server.stop()
        engine.shutdown()

    worst = {name: max(metrics[f"{name}_{c}"] for c in args.concurrencies)
             for name in ("p50_added_ms_per_request", "p50_added_ms_per_token")}
    metrics = {**worst, **metrics}
    return {
        "benchmark": "api_overhead",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "config": {
            "model": DEFAULT_MODEL_NAME, "weights": "random (same architecture)" if args.random_weights else "GGUF Q4_1, dequantized",
            "dtype": settings.resolve_dtype(), "device": settings.resolve_device(),
            "concurrencies": args.concurrencies, "requests_per_phase": [c * args.requests_per_worker
                                                                        for c in args.concurrencies],
            "max_tokens": m, "repeats": args.repeats, "stream_tokens_at_64": args.stream_tokens,
            "tiny_requests": args.tiny_requests, "engine_cpu_threads": settings.resolve_engine_cpu_threads() or "torch default", "client": f"openai.AsyncOpenAI, streams and requests spread over {args.client_processes} client processes",
            "server": "loraplex serve: supervisor + engine-core process + 1 API server (2 and 4 for the 64-stream "
                      "throughput and tiny-request comparisons), ZeroMQ/msgspec between them, SQLite and the file journal (no Redis); "
                      "in-process: the engine alone (LLMEngine.step in a plain loop in the benchmark process, no event "
                      "loop or consumer sharing its GIL), and an AsyncEngine on the same engine for comparison",
        },
        "metrics": metrics,
        "targets": {
            "p50_added_ms_per_request": {"op": "<=", "value": 5.0},
            "p50_added_ms_per_token": {"op": "<=", "value": 0.1},
            "http_over_inprocess_throughput_64": {"op": ">=", "value": 0.95},
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
    parser.add_argument("--client-processes", type=int, default=None,
                        help="client processes the HTTP requests are spread over (default: 8; quick: 2)")
    parser.add_argument("--engine-cpu-threads", type=int, default=None,
                        help="the server's LORAPLEX_ENGINE_CPU_THREADS (default 0: its own default; quick: 1, for "
                             "the engine alone too, as OpenMP threads spinning on a busy 2-core machine slow CPU steps)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: results/ on full runs)")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="after timing, run the tiny and 64-stream phases once more under py-spy (if installed), "
                             "writing collapsed stacks of each server process here")
    args = parser.parse_args()
    # Quick: the same phases on one server (two API server processes), at 8 concurrent requests.
    args.concurrencies, args.api_servers = ([8], [2]) if args.quick else ([16, 64], [1, 2, 4])
    args.requests_per_worker, args.max_tokens, args.repeats, args.stream_tokens, args.tiny_requests = (
        (1, 4, 1, 4, 32) if args.quick else (3, 32, 3, 32, 512)
    )
    args.client_processes = args.client_processes or (2 if args.quick else 8)
    if args.engine_cpu_threads is None:
        args.engine_cpu_threads = 1 if args.quick else 0
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
