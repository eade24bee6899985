"""Replicas benchmark: two `loraplex serve` replicas (one GPU each) behind HAProxy, against one replica.

Both replicas run the same model (random weights of the given folder's architecture, seeded alike, or the
real weights), one engine core and one API server each, on one shared SQLite database; HAProxy runs the
shipped deploy/haproxy/haproxy.cfg unchanged (header-hash + stick-on-response affinity, /readyz checks).

- throughput: closed-loop clients (greedy, `ignore_eos`, `max_tokens` each, non-streaming), C of them
  against one replica, then 2C through the balancer: `aggregate_throughput_ratio_2_replicas` is the
  balancer's generated tokens/s over one replica's (each replica sees the same load);
- sessions: S sessions of T turns against one replica, then 2S through the balancer, each turn streamed
  with its `x-session-id`: `session_turn10_ttft_ratio_2_replicas` is the balancer's p50 time to first
  token of the last turn over one replica's (affinity keeps each session on the replica holding its KV;
  without it every turn would prefill the whole conversation again);
- a kill: clients keep sending through the balancer while one replica is SIGKILLed; a request that still
  fails after the retries the openai SDK makes by default (2, of connection errors and 5xx) is lost
  (`lost_requests_on_replica_kill`); the failed attempts that were sent again are counted beside it
  (`retried_attempts_on_replica_kill`: HAProxy 2.6 answers 502 for a request in flight on a replica that dies).

Checked before timing: a greedy answer is the same from either replica and through the balancer, and every
session's turns after the first are served from its pinned KV (cached tokens cover the previous turn).

    python benchmarks/replicas.py --device cuda --random-weights .bench_model/SmolLM2-135M-Instruct
    python benchmarks/replicas.py --quick     # CPU, small sizes; writes nothing
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is loaded
from serve_health import wait_healthy

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "replicas.json"
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
SDK_MAX_RETRIES = 2  # the openai SDK's default max_retries
PROMPT = "Write a long story about a lighthouse keeper and the sea."
TURNS = ["Hello, my name is Ada.", "I live in a small town by the sea.", "I keep a lighthouse.",
         "Tell me about ships.", "What about storms?", "And the tides?", "Any advice on lamps?",
         "What should I read?", "Summarize our talk.", "What is my name and where do I live?"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Replica:
    """`loraplex serve` in its own process group, on GPU `gpu` (None: the CPU)."""

    def __init__(self, name: str, env: dict[str, str], gpu: int | None, work: Path) -> None:
        self.name, self.port, self.log = name, free_port(), work / f"{name}.log"
        env = {**env, "LORAPLEX_REPLICA_ID": name, "LORAPLEX_DATA_DIR": str(work / name)}
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        (work / name).mkdir()
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "loraplex.platform.cli.main", "serve", "--port", str(self.port)],
                cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


def start_balancer(haproxy: str, replicas: list[Replica], work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "LORAPLEX_LB_BIND": f"127.0.0.1:{port}", "LORAPLEX_LB_LOG": "stdout",
           "LORAPLEX_REPLICA_1": f"127.0.0.1:{replicas[0].port}", "LORAPLEX_REPLICA_2": f"127.0.0.1:{replicas[1].port}"}
    log = work / "haproxy.log"
    with log.open("wb") as out:
        process = subprocess.Popen([haproxy, "-db", "-f", str(HAPROXY_CFG)], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url + "/readyz", process, log, timeout_s=60)
    return process, url


# ---- load -------------------------------------------------------------------------------------------

def chat_body(content: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


async def _closed_loop(url: str, key: str, model: str, clients: int, max_tokens: int, until: float
                       ) -> list[tuple[float, int, str]]:
    """One process's clients, each sending one request after another until `until` (wall clock); per request:
    (when it ended, tokens generated, "" or what went wrong)."""
    import httpx

    records: list[tuple[float, int, str]] = []

    async def attempt(client: httpx.AsyncClient) -> tuple[int, str]:
        try:
            response = await client.post(url + "/v1/chat/completions", json={
                **chat_body(PROMPT, max_tokens, ignore_eos=True), "model": model})
        except httpx.HTTPError as exc:
            return 0, type(exc).__name__
        if response.status_code != 200:
            return 0, f"HTTP {response.status_code}"
        return response.json()["usage"]["completion_tokens"], ""

    async def one_client(client: httpx.AsyncClient) -> None:
        while time.time() < until:
            # As the openai SDK does by default: up to 2 retries of a connection error, 408, 429 or 5xx. Safe here:
            # a request whose replica died before it ended was never metered there.
            for retry in range(SDK_MAX_RETRIES + 1):
                tokens, error = await attempt(client)
                retryable = error.startswith(("HTTP 5", "HTTP 408", "HTTP 429")) or (error and "HTTP" not in error)
                if not retryable or retry == SDK_MAX_RETRIES:
                    break
                records.append((time.time(), 0, "retried: " + error))
                await asyncio.sleep(0.5 * 2**retry)
            records.append((time.time(), tokens, error))

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=600, limits=limits) as client:
        await asyncio.gather(*(one_client(client) for _ in range(clients)))
    return records


def _closed_loop_process(url: str, key: str, model: str, clients: int, max_tokens: int, until: float
                         ) -> list[tuple[float, int, str]]:
    return asyncio.run(_closed_loop(url, key, model, clients, max_tokens, until))


def closed_loop(url: str, key: str, model: str, clients: int, max_tokens: int, duration_s: float, processes: int,
                kill_at_s: float | None = None, victim: Replica | None = None) -> dict[str, Any]:
    """`clients` closed-loop clients spread over `processes` client processes (one Python process holding many
    httpx clients tops out near 80 requests/s and would measure itself); optionally SIGKILL `victim` on the way."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    start = time.time()
    until = start + duration_s
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_closed_loop_process, url, key, model, n, max_tokens, until) for n in shares if n]
        killed_at = None
        if kill_at_s is not None and victim is not None:
            time.sleep(max(start + kill_at_s - time.time(), 0))
            victim.kill()
            killed_at = time.time()
        records = [record for future in futures for record in future.result()]
    seconds = max(r[0] for r in records) - start if records else duration_s
    retried = [r[2] for r in records if r[2].startswith("retried: ")]
    errors = [r[2] for r in records if r[2] and not r[2].startswith("retried: ")]
    done = [r for r in records if not r[2]]
    return {
        "requests": len(done), "failed": len(errors), "retried_attempts": len(retried),
        "tokens": sum(r[1] for r in done), "seconds": seconds, "tokens_per_s": sum(r[1] for r in done) / seconds,
        "after_kill": sum(1 for r in done if killed_at is not None and r[0] > killed_at),
        "error_kinds": {kind: errors.count(kind) for kind in sorted(set(errors))},
        "retried_kinds": {kind: retried.count(kind) for kind in sorted(set(retried))},
    }


async def session_turns(url: str, key: str, model: str, sessions: int, turns: int, max_tokens: int
                        ) -> list[list[dict[str, float]]]:
    """`sessions` conversations at once, each `turns` streamed turns carrying its x-session-id; per session,
    per turn: time to first token, prompt and cached tokens."""
    import httpx

    async def one_session(client: httpx.AsyncClient) -> list[dict[str, float]]:
        created = await client.post(url + "/v1/sessions", json={"model": model})
        created.raise_for_status()
        headers = {"x-session-id": created.headers["x-session-id"]}
        out = []
        for text in TURNS[:turns]:
            sent = time.monotonic()
            first: float | None = None
            usage: dict[str, Any] = {}
            body = {**chat_body(text, max_tokens, ignore_eos=True), "model": model, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        first = time.monotonic()
                    usage = chunk.get("usage") or usage
            out.append({"ttft_s": (first or time.monotonic()) - sent, "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
        return out

    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
        return list(await asyncio.gather(*(one_session(client) for _ in range(sessions))))


def _session_process(url: str, key: str, model: str, sessions: int, turns: int, max_tokens: int
                     ) -> list[list[dict[str, float]]]:
    return asyncio.run(session_turns(url, key, model, sessions, turns, max_tokens))


def spread_sessions(url: str, key: str, model: str, sessions: int, turns: int, max_tokens: int, processes: int
                    ) -> list[list[dict[str, float]]]:
    """`session_turns` with the sessions spread over client processes (at most 4 sessions a process)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    processes = max(1, min(processes, (sessions + 3) // 4))
    shares = [sessions // processes + (i < sessions % processes) for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_session_process, url, key, model, n, turns, max_tokens) for n in shares if n]
        return [session for future in futures for session in future.result()]


def check_affinity(sessions: list[list[dict[str, float]]], block_size: int) -> None:
    for turns in sessions:
        for before, turn in itertools.pairwise(turns):
            if turn["cached_tokens"] < before["prompt_tokens"] - block_size:
                raise SystemExit(f"a session turn was not served from its pinned KV: {turns}")


def greedy_answer(url: str, key: str, model: str, max_tokens: int) -> str:
    import httpx

    response = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=600,
                          json={**chat_body(PROMPT, max_tokens), "model": model})
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


# ---- setup ------------------------------------------------------------------------------------------

def prepare(work: Path, model_path: Path) -> tuple[str, str, str]:
    """A migrated SQLite database both replicas share, with one tenant; (database url, key, model name)."""
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.db import migrate
    from loraplex.platform.db.session import make_db_engine, make_session_factory

    database_url = f"sqlite:///{work / 'loraplex.db'}"
    migrate.upgrade(database_url)
    engine = make_db_engine(database_url)
    with make_session_factory(engine)() as db:
        tenant = store.create_tenant(db, name="bench")
        key = store.create_api_key(db, tenant=tenant, scopes=[Scope.INFERENCE]).key
    engine.dispose()
    return database_url, key, model_path.name


def machine(device: str) -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu,
            "gpus": torch.cuda.device_count() if device == "cuda" else 0, "torch": torch.__version__,
            "load_average_1m_at_end": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CPU, small sizes, one repeat; writes nothing")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--random-weights", type=Path, help="a model folder (config.json + tokenizer): random weights")
    parser.add_argument("--haproxy", default="haproxy", help="the haproxy binary")
    parser.add_argument("--clients", type=int, default=64, help="closed-loop clients per replica")
    parser.add_argument("--client-processes", type=int, default=8, help="client processes per replica's clients")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of each throughput phase")
    parser.add_argument("--sessions", type=int, default=16, help="sessions per replica")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--session-max-tokens", type=int, default=16, help="tokens generated per session turn")
    parser.add_argument("--check-max-tokens", type=int, default=32, help="tokens of the greedy answer compared")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the throughput phases")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--log-dir", type=Path, help="copy the replicas' and HAProxy's logs here at the end")
    args = parser.parse_args()
    if args.quick:
        # The quick run checks that every phase runs, not the figures: short phases, few tokens, and no warm-up
        # (the greedy check has already sent a request to each replica and through the balancer).
        args.device, args.clients, args.max_tokens, args.duration, args.client_processes = "cpu", 2, 8, 3.0, 1
        args.sessions, args.turns, args.session_max_tokens, args.check_max_tokens, args.warmup = 1, 3, 4, 8, 0.0
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit(f"two GPUs are needed, {torch.cuda.device_count()} found")
    from loraplex.engine.model.default_model import ensure_default_model

    model_path = (args.random_weights or ensure_default_model(ROOT / "data" / "models")).resolve()
    with tempfile.TemporaryDirectory(prefix="lpx-replicas-") as tmp:
        work = Path(tmp)
        database_url, key, model = prepare(work, model_path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        env.update({"LORAPLEX_DATABASE_URL": database_url, "LORAPLEX_MIGRATE_ON_START": "false",
                    "LORAPLEX_MODEL_PATH": str(model_path), "LORAPLEX_DEVICE": args.device,
                    "LORAPLEX_RANDOM_WEIGHTS": str(args.random_weights is not None).lower(),
                    "LORAPLEX_DEFAULT_RPM": "0", "LORAPLEX_DEFAULT_TPM": "0", "LORAPLEX_LOG_LEVEL": "warning",
                    "LORAPLEX_MAX_NUM_SEQS": str(max(8, 2 * args.clients)), "LORAPLEX_MAX_PENDING_REQUESTS": "4096",
                    "LORAPLEX_MAX_MODEL_LEN": "4096", "LORAPLEX_API_SERVERS": "1",
                    "LORAPLEX_KV_CACHE_MEMORY_MB": "64" if args.device == "cpu" else "8192"})
        if args.quick:
            # No batch work is sent: on two CPU cores each replica's idle batch-worker process costs ~8 CPU-seconds;
            # and two replicas' engines on those two cores compute on one thread each (spinning OpenMP threads
            # of one slowed the other's steps)
            env["LORAPLEX_BATCH_WORKERS_ENABLED"] = "false"
            env["LORAPLEX_ENGINE_CPU_THREADS"] = "1"
        replicas = [Replica(f"replica-{i + 1}", env, i if args.device == "cuda" else None, work) for i in range(2)]
        balancer = None
        try:
            for replica in replicas:
                wait_healthy(replica.url + "/healthz", replica.process, replica.log)
            balancer, lb = start_balancer(args.haproxy, replicas, work)
            results = run(args, replicas, lb, key, model)
        finally:
            if balancer is not None and balancer.poll() is None:
                os.killpg(balancer.pid, signal.SIGTERM)
            for replica in replicas:
                replica.stop()
            if args.log_dir is not None:
                args.log_dir.mkdir(parents=True, exist_ok=True)
                for log in work.glob("*.log"):
                    (args.log_dir / log.name).write_bytes(log.read_bytes()[-2_000_000:])
    results["machine"] = machine(args.device)
    print(json.dumps(results["metrics"], indent=2))
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


def run(args: argparse.Namespace, replicas: list[Replica], lb: str, key: str, model: str) -> dict[str, Any]:
    one = replicas[0]
    answers = {url: greedy_answer(url, key, model, args.check_max_tokens) for url in (one.url, replicas[1].url, lb)}
    if len(set(answers.values())) != 1:
        raise SystemExit(f"the replicas answer differently: {answers}")
    # warm-up, then one replica alone, then both through the balancer (each replica sees `clients`)
    procs = args.client_processes
    if args.warmup > 0:
        closed_loop(lb, key, model, 2 * args.clients, args.max_tokens, min(args.warmup, args.duration), 2 * procs)
    single = closed_loop(one.url, key, model, args.clients, args.max_tokens, args.duration, procs)
    double = closed_loop(lb, key, model, 2 * args.clients, args.max_tokens, args.duration, 2 * procs)
    print(f"throughput: one replica {single['tokens_per_s']:.0f} tok/s, two {double['tokens_per_s']:.0f} tok/s")

    alone = spread_sessions(one.url, key, model, args.sessions, args.turns, args.session_max_tokens, procs)
    spread = spread_sessions(lb, key, model, 2 * args.sessions, args.turns, args.session_max_tokens, 2 * procs)
    for sessions in (alone, spread):
        check_affinity(sessions, block_size=16)
    last_alone = statistics.median(s[-1]["ttft_s"] for s in alone)
    last_spread = statistics.median(s[-1]["ttft_s"] for s in spread)
    print(f"turn-{args.turns} TTFT p50: one replica {last_alone * 1000:.1f} ms, two {last_spread * 1000:.1f} ms")

    kill = closed_loop(lb, key, model, 2 * args.clients, args.max_tokens, args.duration, 2 * procs,
                       kill_at_s=args.duration / 3, victim=replicas[1])
    if kill["after_kill"] == 0:
        raise SystemExit(f"nothing was served after the kill: {kill}")
    print(f"kill: {kill['requests']} served ({kill['after_kill']} after the kill), {kill['failed']} lost "
          f"{kill['error_kinds']}, {kill['retried_attempts']} attempts retried {kill['retried_kinds']}")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "benchmark": "replicas", "date": now,
        "config": {"model": model, "weights": "random" if args.random_weights else "real", "device": args.device,
                   "replicas": 2, "api_servers_per_replica": 1, "clients_per_replica": args.clients,
                   "max_tokens": args.max_tokens, "duration_s": args.duration, "sessions_per_replica": args.sessions,
                   "turns": args.turns, "client_processes_per_replica": args.client_processes, "balancer": "haproxy " + haproxy_version(args.haproxy),
                   "database": "sqlite (shared)", "redis": None},
        "metrics": {
            "aggregate_throughput_ratio_2_replicas": round(double["tokens_per_s"] / single["tokens_per_s"], 3),
            f"session_turn{args.turns}_ttft_ratio_2_replicas": round(last_spread / last_alone, 3),
            "lost_requests_on_replica_kill": kill["failed"],
            "tokens_per_s_1_replica": round(single["tokens_per_s"], 1),
            "tokens_per_s_2_replicas": round(double["tokens_per_s"], 1),
            f"turn{args.turns}_ttft_ms_p50_1_replica": round(last_alone * 1000, 2),
            f"turn{args.turns}_ttft_ms_p50_2_replicas": round(last_spread * 1000, 2),
            "turn1_ttft_ms_p50_2_replicas": round(statistics.median(s[0]["ttft_s"] for s in spread) * 1000, 2),
            "requests_served_during_kill_phase": kill["requests"],
            "requests_served_after_kill": kill["after_kill"],
            "errors_1_replica": single["failed"], "errors_2_replicas": double["failed"],
            "lost_request_kinds_on_replica_kill": kill["error_kinds"],
            # attempts that failed and were sent again (the client retries as the openai SDK does by default)
            "retried_attempts_on_replica_kill": kill["retried_attempts"],
            "retried_attempt_kinds_on_replica_kill": kill["retried_kinds"],
        },
        "targets": {"aggregate_throughput_ratio_2_replicas": {"op": ">=", "value": 1.9},
                    f"session_turn{args.turns}_ttft_ratio_2_replicas": {"op": "<=", "value": 1.1},
                    "lost_requests_on_replica_kill": {"op": "==", "value": 0}},
        "checked": True,
    }


def haproxy_version(binary: str) -> str:
    out = subprocess.run([binary, "-v"], capture_output=True, text=True).stdout
    return out.split()[2] if out.startswith("HAProxy version") else "unknown"


if __name__ == "__main__":
    main()
