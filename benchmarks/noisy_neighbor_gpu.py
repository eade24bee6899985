"""Noisy neighbour on a GPU: one tenant's flood of long streams against a quiet tenant's time to first token.

A real `loraplex serve` (engine-core process + API servers) on the GPU, SmolLM2-135M shapes with random
weights, default settings but rate limits off. A flood tenant opens N concurrent streams of 1,000 tokens
(N = 64, then 256: the server's whole `max_pending_requests`) from its own client process, while a quiet
tenant sends 16-token streams one at a time from this process and times the first token. The quiet p95 comes
from 120 requests to the same server before the floods. The same floods run again on a server with fair sharing off: all
tenants' tokens per second with fair sharing over without it says whether fairness wastes the GPU: judged
on all tokens over the flood's wall time and on the engine's steady rate (its generated-token counter from the
flood's start while the flood can fill every running slot). Both servers are up at once and their phases taken
in turn, so the drift of a host's rate over minutes falls on both alike.

Checked before timed: every victim reply is a 200 stream with its 16 tokens; every flood stream is a 200 with
its 1,000 tokens or a 429 naming the tenant's share (never a 5xx).

    python benchmarks/noisy_neighbor_gpu.py          # GPU: merges gpu_flood_* into results/noisy_neighbor.json
    python benchmarks/noisy_neighbor_gpu.py --quick  # CPU, small sizes, fair sharing on only; writes nothing
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
from api_overhead import ServedProcesses
from loraplex.engine.host_info import cpu_benchmark_machine
from loraplex.platform.settings import api_servers_for_this_machine
from steady_window import engine_full_until, steady_tokens_per_s

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "noisy_neighbor.json"
MODEL = "SmolLM2-135M-Instruct"
TARGET_TTFT_RATIO, TARGET_THROUGHPUT_RATIO = 2.0, 0.9
# The quiet baseline's requests: its p95 is the ratio's denominator. Of 30 it was the second slowest request
# and swung between 6.3 and 8.3 ms across two calls on one kind of card; the flood phases time hundreds.
QUIET_REQUESTS = 120


class FloodServer(ServedProcesses):
    def __init__(self, settings: Any, api_servers: int, extra: tuple[str, ...] = ()) -> None:
        names = (*ServedProcesses.setting_names, "fair_sharing", "cuda_graph_mixed_steps", *extra)
        if settings.newcomer_reserved_slots is not None:  # unset: the server's own default
            names = (*names, "newcomer_reserved_slots")
        self.setting_names = names
        super().__init__(settings, api_servers)


def server_settings(data_dir: Path, model_path: Path, *, gpu: bool, fair: bool, max_tokens: int,
                    mixed_graphs: bool = True, kept_slots: int | None = None,
                    extra: dict[str, str] | None = None) -> Any:
    from loraplex.platform.settings import Settings

    values: dict[str, Any] = {
        "data_dir": data_dir, "model_path": model_path, "device": "cuda" if gpu else "cpu", "random_weights": gpu,
        "default_rpm": 0, "default_tpm": 0, "log_level": "warning", "fair_sharing": fair,
        "cuda_graph_mixed_steps": mixed_graphs, "newcomer_reserved_slots": kept_slots,
        "max_model_len": max(2048, 128 + max_tokens), "kv_cache_memory_mb": 4096 if gpu else 128,
        # The two servers share one GPU: each sizes its KV pool from this share of it (40% holds over 100,000 blocks
        # of SmolLM2 shapes, far more than 256 streams of ~1,100 tokens use)
        "gpu_memory_utilization": 0.4,
        # Settings' defaults otherwise (max_num_seqs 64, max_pending_requests 256). The API servers are as many as
        # `serve` starts on this machine in production, with Redis (`api_servers_for_this_machine`).
    }
    return Settings(**{**values, **(extra or {})})  # --server-setting overrides any of the above


def seed_keys(database_url: str) -> dict[str, str]:
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.db import migrate
    from loraplex.platform.db.session import make_db_engine, make_session_factory

    migrate.upgrade(database_url)
    engine = make_db_engine(database_url)
    with make_session_factory(engine)() as db:
        keys = {name: store.create_api_key(db, tenant=store.create_tenant(db, name=name), scopes=[Scope.INFERENCE]).key
                for name in ("victim", "flood")}
    engine.dispose()
    return keys


# ---- the flood: its own process, asyncio streams ---------------------------------------------------

async def _flood(base_url: str, key: str, num_streams: int, max_tokens: int,
                 options: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}} | (options or {})
    counts: dict[str, Any] = {"tokens": 0, "served": 0, "refused": 0, "errors": [], "ends": []}

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/chat/completions", json=body) as reply:
            if reply.status_code == 429:
                await reply.aread()
                code = reply.json()["error"]["code"]
                if code != "tenant_share_exceeded":
                    counts["errors"].append(f"429 {code}")
                counts["refused"] += 1
                return
            if reply.status_code != 200:
                counts["errors"].append(f"{reply.status_code} {(await reply.aread())[:200]!r}")
                return
            tail = b""
            async for raw in reply.aiter_raw():  # bytes as they come: the client must never be the bottleneck
                tail = (tail + raw)[-4096:]
            usage = None
            for line in tail.decode(errors="replace").splitlines():
                if line.startswith("data: {") and '"usage"' in line:  # the include_usage chunk (and nulls)
                    with contextlib.suppress(ValueError):
                        usage = json.loads(line[6:]).get("usage") or usage
            if not usage or usage["completion_tokens"] != max_tokens:
                counts["errors"].append(f"stream ended short: {usage}")
                return
            counts["tokens"] += usage["completion_tokens"]
            counts["served"] += 1
            counts["ends"].append(time.time())  # wall clock: compared across processes

    limits = httpx.Limits(max_connections=num_streams + 8, max_keepalive_connections=num_streams + 8)
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=900,
                                 limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(num_streams)))
        counts["wall_s"] = time.perf_counter() - start
    return counts


def flood_worker(conn: Any, base_url: str, key: str, num_streams: int, max_tokens: int,
                 options: dict[str, Any] | None = None) -> None:
    conn.recv()  # "go"
    conn.send(asyncio.run(_flood(base_url, key, num_streams, max_tokens, options)))


def split(num_streams: int, gpu: bool) -> list[int]:
    """The flood's streams over client processes (32 a process on the GPU run: the client is never the limit)."""
    num_processes = max(1, num_streams // 32) if gpu else 1
    return [num_streams // num_processes + (i < num_streams % num_processes) for i in range(num_processes)]


class Flood:
    def __init__(self, base_url: str, key: str, num_streams: int, max_tokens: int,
                 options: dict[str, Any] | None = None) -> None:
        self.conn, child = get_context("spawn").Pipe()
        self.process = get_context("spawn").Process(target=flood_worker, args=(child, base_url, key, num_streams,
                                                                                max_tokens, options), daemon=True)
        self.process.start()

    def result(self) -> dict[str, Any]:
        out = self.conn.recv()
        self.process.join(timeout=60)
        return out


# ---- the victim ---------------------------------------------------------------------------------------

def victim_request(client: httpx.Client, num_tokens: int) -> tuple[float, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": num_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    usage = None
    with client.stream("POST", "/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"victim request failed: {reply.status_code} {reply.read()[:300]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if ttft is None or not usage or usage["completion_tokens"] != num_tokens:
        raise RuntimeError(f"victim stream incomplete: ttft={ttft} usage={usage}")
    return ttft, usage["completion_tokens"]


def generated_tokens(base_url: str) -> float:
    """The server's count of generated tokens, all tenants (every API server's /metrics has the total)."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def engine_steps(base_url: str) -> dict[str, float]:
    """The engine's steps so far by how they ran (`loraplex_engine_steps_total{kind}`; none on the CPU), and its
    preemptions (`preemptions`: each one's sequence is computed again, in steps that carry a prefill)."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    steps = {}
    for line in text.splitlines():
        if line.startswith("loraplex_engine_steps_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            steps[kind] = float(line.split()[-1])
        elif line.startswith("loraplex_engine_preemptions "):
            steps["preemptions"] = float(line.split()[-1])
    return steps


class TokenCounterSampler:
    """(wall time, generated tokens so far) every 0.25 s from a thread, whatever the victim is waiting for."""

    def __init__(self, base_url: str) -> None:
        self.samples: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base_url,), daemon=True)
        self._thread.start()

    def _run(self, base_url: str) -> None:
        while not self._done.is_set():
            self.samples.append((time.time(), generated_tokens(base_url)))
            self._done.wait(0.25)

    def stop(self) -> list[tuple[float, float]]:
        self._done.set()
        self._thread.join(timeout=30)
        return self.samples


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[94] if len(values) > 1 else values[0]


def merged_phases(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated flood phases as one: the victim's requests pooled, rates averaged, counts summed."""
    steady = [p["steady_tokens_per_s"] for p in phases if p["steady_tokens_per_s"]]
    steps: dict[str, float] = {}
    for p in phases:
        for kind, count in p["engine_steps"].items():
            steps[kind] = steps.get(kind, 0.0) + count
    return {"victim_ttft_s": [t for p in phases for t in p["victim_ttft_s"]],
            "flood_served": sum(p["flood_served"] for p in phases), "flood_refused": sum(p["flood_refused"] for p in phases),
            "tokens_per_s": statistics.mean(p["tokens_per_s"] for p in phases),
            "wall_s": sum(p["wall_s"] for p in phases),
            "steady_tokens_per_s": statistics.mean(steady) if len(steady) == len(phases) else None,
            "engine_steps": steps, "repeats": len(phases)}


class ServedForFloods:
    """One `loraplex serve` for the floods, its two tenants' keys, and its phases so far."""

    def __init__(self, data_dir: Path, model_path: Path, *, gpu: bool, fair: bool, max_tokens: int,
                 mixed_graphs: bool = True, kept_slots: int | None = None, extra: dict[str, str] | None = None,
                 api_servers: int | None = None, flood_options: dict[str, Any] | None = None) -> None:
        self.fair, self.gpu, self.data_dir = fair, gpu, data_dir
        self.flood_options = flood_options  # merged into each flood request's body
        self.settings = server_settings(data_dir, model_path, gpu=gpu, fair=fair, max_tokens=max_tokens,
                                        mixed_graphs=mixed_graphs, kept_slots=kept_slots, extra=extra)
        self.keys = seed_keys(self.settings.resolved_database_url)
        self.server = FloodServer(self.settings, api_servers=api_servers or (api_servers_for_this_machine() if gpu else 1),
                                  extra=tuple(extra or ()))
        self.out: dict[str, Any] = {}

    def __enter__(self) -> ServedForFloods:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.server.base_url, headers={"Authorization": f"Bearer {self.keys['victim']}"},
                            timeout=900)

    def quiet_baseline(self, victim_tokens: int, num_quiet: int) -> None:
        self.server.wait_healthy()
        with self.client() as client:
            for _ in range(3):
                victim_request(client, victim_tokens)  # warm-up
            self.out["quiet_ttft_s"] = [victim_request(client, victim_tokens)[0] for _ in range(num_quiet)]

    def flood_phase(self, size: int, max_tokens: int, victim_tokens: int) -> None:
        """One flood of `size` streams with the victim timed beside it, added to `out[flood_{size}]`."""
        base_url = self.server.base_url
        with self.client() as client:
            floods = [Flood(base_url, self.keys["flood"], part, max_tokens, self.flood_options)
                      for part in split(size, self.gpu)]
            for flood_process in floods:
                flood_process.conn.send("go")
            time.sleep(1.0 if self.gpu else 3.0)  # the flood holds its streams before the victim is timed
            ttfts, victim_tokens_total = [], 0
            steps_before = engine_steps(base_url)
            sampler = TokenCounterSampler(base_url)
            # At least one victim request: on a loaded CPU a small flood can be over before the first one (an
            # empty phase failed the quick run with an IndexError instead of measuring anything).
            while True:
                ttft, tokens = victim_request(client, victim_tokens)
                ttfts.append(ttft)
                victim_tokens_total += tokens
                if all(f.conn.poll() for f in floods):
                    break
            samples = sampler.stop()
            steps = {kind: count - steps_before.get(kind, 0.0) for kind, count in engine_steps(base_url).items()}
        parts = [f.result() for f in floods]
        flood = {"errors": [e for p in parts for e in p["errors"]], "served": sum(p["served"] for p in parts),
                 "refused": sum(p["refused"] for p in parts), "tokens": sum(p["tokens"] for p in parts),
                 "wall_s": max(p["wall_s"] for p in parts)}
        if flood["errors"]:
            raise RuntimeError(f"flood of {size}: {flood['errors'][:3]}")
        ends = sorted(e for p in parts for e in p["ends"])
        phase = {
            "victim_ttft_s": ttfts, "flood_served": flood["served"], "flood_refused": flood["refused"],
            "tokens_per_s": (flood["tokens"] + victim_tokens_total) / flood["wall_s"],
            "wall_s": flood["wall_s"],
            "steady_tokens_per_s": steady_tokens_per_s(samples, engine_full_until(ends, self.settings.max_num_seqs)),
            "engine_steps": steps,
        }
        self.out.setdefault(f"flood_{size}_phases", []).append(phase)
        self.out[f"flood_{size}"] = merged_phases(self.out[f"flood_{size}_phases"])
        quiet = p95(self.out["quiet_ttft_s"])
        print(f"fair={self.fair} flood={size}: victim ttft p95 {p95(ttfts) * 1e3:.1f} ms (p50 "
              f"{statistics.median(ttfts) * 1e3:.1f}, max {max(ttfts) * 1e3:.1f}) over {len(ttfts)} requests (quiet "
              f"{quiet * 1e3:.1f} ms); {phase['tokens_per_s']:.0f} tokens/s (steady {phase['steady_tokens_per_s'] or 0:.0f}); "
              f"flood served {flood['served']}, refused {flood['refused']}; steps {steps}", flush=True)

    def keep_logs(self, into: Path) -> None:
        into.mkdir(parents=True, exist_ok=True)
        for log in self.data_dir.glob("serve-*.log"):
            shutil.copy(log, into / f"{'fair' if self.fair else 'unfair'}-{log.name}")


def run_servers(model_path: Path, *, gpu: bool, fairness: list[bool], sizes: list[int], max_tokens: int,
                victim_tokens: int, num_quiet: int, repeats: int, mixed_graphs: bool = True,
                kept_slots: int | None = None, extra: dict[str, str] | None = None, keep_logs: Path | None = None,
                api_servers: int | None = None, flood_options: dict[str, Any] | None = None
                ) -> dict[bool, dict[str, Any]]:
    """Both servers (fair sharing on, off) up at once, their flood phases interleaved: on, off, then off, on.

    One server's rate drifts by ~10% from one start to the next and from minute to minute on a shared host;
    phases taken in turn on two live servers see the same drift, and their ratio does not."""
    with contextlib.ExitStack() as stack:
        servers = {}
        for fair in fairness:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flood-")))
            servers[fair] = stack.enter_context(ServedForFloods(
                data_dir, model_path, gpu=gpu, fair=fair, max_tokens=max_tokens, mixed_graphs=mixed_graphs,
                kept_slots=kept_slots, extra=extra, api_servers=api_servers, flood_options=flood_options))
            if keep_logs is not None:  # the temporary data folder goes with the run
                stack.callback(servers[fair].keep_logs, keep_logs)
        for served in servers.values():
            served.quiet_baseline(victim_tokens, num_quiet)
        for repeat in range(repeats):
            for size in sizes:
                for fair in (fairness if repeat % 2 == 0 else fairness[::-1]):
                    servers[fair].flood_phase(size, max_tokens, victim_tokens)
        return {fair: served.out for fair, served in servers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, small sizes, fair sharing on only; writes nothing")
    parser.add_argument("--repeats", type=int, default=3,
                        help="GPU: each flood phase this many times per server (rates averaged, victims pooled)")
    parser.add_argument("--newcomer-reserved-slots", type=int, default=None,
                        help="the servers' LORAPLEX_NEWCOMER_RESERVED_SLOTS (default: the server's own); writes nothing")
    parser.add_argument("--mixed-graphs-off-too", action="store_true",
                        help="GPU: also run both servers with mixed-step graphs off (metrics suffixed _mixed_off)")
    parser.add_argument("--server-setting", action="append", default=[], metavar="NAME=VALUE",
                        help="a server setting for both servers (e.g. overlap_scheduling=true); repeatable; "
                             "writes nothing")
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                        help="copy the servers' logs into DIR (their data folders are temporary)")
    parser.add_argument("--fair-only", action="store_true", help="GPU: only the server with fair sharing on; writes nothing")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, metavar="N",
                        help="GPU: these flood sizes instead of 64 and 256 (for profiling one); writes nothing")
    parser.add_argument("--api-servers", type=int, default=None, metavar="N",
                        help="API server processes (default: what serve starts with Redis on this machine on a "
                             "GPU, 1 on the CPU); writes nothing")
    parser.add_argument("--flood-option", action="append", default=[], metavar="NAME=JSON",
                        help="a field of every flood request (e.g. top_logprobs=5, presence_penalty=0.5); repeatable; "
                             "writes nothing")
    args = parser.parse_args()
    extra = dict(setting.partition("=")[::2] for setting in args.server_setting)
    flood_options = {name: json.loads(value) for name, _, value in (o.partition("=") for o in args.flood_option)}
    import torch
    from loraplex.engine.model.default_model import ensure_default_model

    gpu = torch.cuda.is_available() and not args.quick
    model_path = ROOT / ".bench_model" / "SmolLM2-135M-Instruct" if gpu else ensure_default_model(ROOT / "data" / "models")
    sizes, max_tokens, victim_tokens, num_quiet = ([64, 256], 1000, 16, QUIET_REQUESTS) if gpu else ([6], 24, 4, 3)
    if gpu and args.sizes:
        sizes = args.sizes
    metrics: dict[str, float] = {}
    for mixed_graphs in ([True, False] if gpu and args.mixed_graphs_off_too else [True]):
        runs = run_servers(model_path, gpu=gpu, fairness=[True, False] if gpu and not args.fair_only else [True],
                           sizes=sizes, max_tokens=max_tokens, victim_tokens=victim_tokens, num_quiet=num_quiet,
                           repeats=args.repeats if gpu else 1, mixed_graphs=mixed_graphs,
                           kept_slots=args.newcomer_reserved_slots, extra=extra, keep_logs=args.keep_logs,
                           api_servers=args.api_servers, flood_options=flood_options)
        suffix = "" if mixed_graphs else "_mixed_off"
        metrics.update({name + suffix: value for name, value in run_metrics(runs, sizes).items()})
    for name, value in metrics.items():
        print(f"{name:<60}{value:>12.3f}")
    if (args.quick or not gpu or args.newcomer_reserved_slots is not None or args.fair_only or extra or args.sizes
            or args.api_servers or flood_options):
        return
    write_result(metrics, sizes, max_tokens, victim_tokens, args.repeats)


def run_metrics(runs: dict[bool, dict[str, Any]], sizes: list[int]) -> dict[str, float]:
    """The figures of one configuration: fair sharing on (`runs[True]`), against off (`runs[False]`) if run."""
    fair_run = runs[True]
    quiet = p95(fair_run["quiet_ttft_s"])
    metrics: dict[str, float] = {"gpu_flood_quiet_ttft_ms_p95": quiet * 1e3}
    for size in sizes:
        for kind, count in fair_run[f"flood_{size}"]["engine_steps"].items():
            metrics[f"gpu_flood_{size}_{kind}" if kind == "preemptions" else f"gpu_flood_{size}_{kind}_steps"] = count
    for size in sizes:
        flood = fair_run[f"flood_{size}"]
        metrics[f"gpu_flood_{size}_victim_ttft_ms_p95"] = p95(flood["victim_ttft_s"]) * 1e3
        metrics[f"gpu_flood_{size}_victim_ttft_p95_ratio"] = p95(flood["victim_ttft_s"]) / quiet
        metrics[f"gpu_flood_{size}_tokens_per_s"] = flood["tokens_per_s"]
        metrics[f"gpu_flood_{size}_refused_for_share"] = flood["flood_refused"]
        if False in runs:
            off = runs[False][f"flood_{size}"]
            metrics[f"gpu_flood_{size}_tokens_per_s_fair_off"] = off["tokens_per_s"]
            metrics[f"gpu_flood_{size}_total_throughput_ratio"] = flood["tokens_per_s"] / off["tokens_per_s"]
            metrics[f"gpu_flood_{size}_victim_ttft_ms_p95_fair_off"] = p95(off["victim_ttft_s"]) * 1e3
            if flood["steady_tokens_per_s"] and off["steady_tokens_per_s"]:
                metrics[f"gpu_flood_{size}_steady_tokens_per_s"] = flood["steady_tokens_per_s"]
                metrics[f"gpu_flood_{size}_steady_tokens_per_s_fair_off"] = off["steady_tokens_per_s"]
                metrics[f"gpu_flood_{size}_steady_throughput_ratio"] = (flood["steady_tokens_per_s"]
                                                                       / off["steady_tokens_per_s"])
                # each pair of phases taken one after the other: how far single comparisons spread
                pairs = [on["steady_tokens_per_s"] / unfair["steady_tokens_per_s"] for on, unfair in
                         zip(fair_run[f"flood_{size}_phases"], runs[False][f"flood_{size}_phases"], strict=True)]
                metrics[f"gpu_flood_{size}_steady_ratio_pair_min"] = min(pairs)
                metrics[f"gpu_flood_{size}_steady_ratio_pair_max"] = max(pairs)
    metrics["gpu_flood_victim_ttft_p95_ratio"] = max(metrics[f"gpu_flood_{s}_victim_ttft_p95_ratio"] for s in sizes)
    metrics["gpu_flood_victim_errors"] = 0  # a victim error raises before this point
    if False in runs:
        metrics["gpu_flood_total_throughput_ratio"] = min(metrics[f"gpu_flood_{s}_total_throughput_ratio"]
                                                          for s in sizes)
        steady = [metrics[f"gpu_flood_{s}_steady_throughput_ratio"] for s in sizes
                  if f"gpu_flood_{s}_steady_throughput_ratio" in metrics]
        if len(steady) == len(sizes):
            metrics["gpu_flood_steady_throughput_ratio"] = min(steady)
    return metrics


def write_result(metrics: dict[str, float], sizes: list[int], max_tokens: int, victim_tokens: int,
                 repeats: int) -> None:
    import torch

    result = json.loads(RESULT.read_text()) if RESULT.exists() else {"benchmark": "noisy_neighbor", "metrics": {},
                                                                      "targets": {}, "checked": True}
    for stale in [name for name in result["metrics"] if name.startswith("gpu_flood") and name not in metrics]:
        del result["metrics"][stale]  # an earlier run's figures of phases this one did not run
    result["metrics"].update(metrics)
    # Judged both ways: all tokens over the flood's wall time (a flood stream held back or preempted that finishes
    # last lengthens it for every token), and the engine's rate while the flood fills it.
    result["targets"].update({"gpu_flood_victim_ttft_p95_ratio": {"op": "<=", "value": TARGET_TTFT_RATIO},
                              "gpu_flood_total_throughput_ratio": {"op": ">=", "value": TARGET_THROUGHPUT_RATIO},
                              "gpu_flood_steady_throughput_ratio": {"op": ">=", "value": TARGET_THROUGHPUT_RATIO}})
    result.setdefault("config", {})["gpu_flood"] = {
        "date": datetime.datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {**cpu_benchmark_machine(), "gpu": torch.cuda.get_device_name()},
        "model": f"{MODEL} shapes, random weights, bfloat16 default", "server": f"loraplex serve, {api_servers_for_this_machine()} API "
        "servers, default settings but rate limits off", "flood": f"{sizes} concurrent streams x {max_tokens} tokens, one "
        "tenant, its own client process", "repeats": f"each flood phase {repeats} times per server, rates averaged, "
        "the victim's requests pooled", "victim": f"{victim_tokens}-token streams one at a time, TTFT",
        "throughput": "all tenants' tokens/s, fair sharing on over off: steady (the server's generated-token "
        "counter from the flood's start while it has a stream for every running slot) and total (all tokens over "
        "the flood's wall); both servers up at once, their phases taken in turn (on, off, then off, on)"}
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
