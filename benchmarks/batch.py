"""Batch API benchmark: a batch on the spare capacity of a server an interactive tenant is using.

A real `loraplex serve` in a subprocess; tenant `batchco` runs batches through
the official `openai` SDK (files.create, batches.create, polling, the output
file), tenant `chatco` sends interactive chat requests one after another.
Every line of a batch is a chat request on one of several adapters or the
base model (mixed adapters, random PEFT weights uploaded at the start), with
one long system prompt shared by all (prefilled once, then read from the
prefix cache), greedy with ignore_eos so each makes exactly max_tokens
tokens. Each phase's user messages carry the phase's tag, so only the shared
prefix is cached across phases. In order:

- quiet: the interactive tenant alone (its p95 latency is the baseline);
- warm-up (full runs): a batch of one line per concurrent slot over every
  model, untimed (first uses of an adapter compile kernels and capture graphs);
- batch alone: one batch of N lines, timed from create to `completed`;
- batch + interactive: another batch of N lines while the interactive tenant
  sends requests until it ends;
- online: the same N requests sent online at full concurrency (the batch's);
- restart (full runs): a batch killed (SIGKILL, the whole server) once a
  third of it is done, then the server restarted on the same database and
  storage: every custom_id must come back exactly once, each in the ledger
  once.

Checked before any figure counts: every batch line and online request is a
200 with exactly max_tokens tokens, and the batch's answers equal the online
ones (greedy; the fraction equal is reported). Tokens are generated
(output) tokens.

Figures (benchmarks/results/batch.json): interactive_p95_ratio_under_batch,
total_throughput_ratio_with_batch (batch + interactive tokens/s over the
batch alone), batch_over_online_throughput, lost_or_duplicated_on_restart.

    python benchmarks/batch.py           # full (2,000 lines): writes benchmarks/results/batch.json
    python benchmarks/batch.py --quick   # small sizes on the CPU, in about a minute; writes nothing
    python benchmarks/batch.py --device cuda --random-weights data/models/SmolLM2-135M-Instruct   # a GPU
    python benchmarks/batch.py --device cuda --random-weights data/models/SmolLM2-135M-Instruct \
        --body-shape Llama-3.1-8B   # the same on random weights in Llama-3.1-8B's layer shapes

`--body-shape` serves a model whose layers have a published model's shapes
(hidden size, layers, heads, MLP width) and whose vocabulary and chat template
are the folder's, so the same prompts and adapters run on a body of a
production size; its figures go into batch.json beside the main ones, with the
suffix `_<shape>` (e.g. `interactive_p95_ratio_under_batch_llama_3_1_8b`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is loaded
from serve_health import wait_healthy

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "batch.json"
SYSTEM = ("You are the support assistant of a small online bookshop. Answer politely and briefly. Orders ship "
          "within two working days; returns are accepted for thirty days with a receipt; gift cards never "
          "expire; the shop is closed on public holidays; customers can track parcels with the number in "
          "their confirmation e-mail; international shipping takes one to three weeks depending on the "
          "country. If you do not know an answer, say so and suggest writing to the shop's help desk.")
QUESTIONS = ["Where is my parcel?", "Can I return a book I bought last week?", "Do gift cards expire?",
             "How long does shipping to Canada take?", "Are you open on holidays?", "How do I track an order?",
             "Can I change my delivery address?", "Do you sell e-books?"]
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True)
class Sizes:
    num_lines: int
    max_tokens: int
    num_adapters: int
    interactive_max_tokens: int
    num_quiet: int
    concurrency: int
    restart_lines: int


QUICK = Sizes(num_lines=8, max_tokens=6, num_adapters=2, interactive_max_tokens=6, num_quiet=4, concurrency=8,
              restart_lines=6)
FULL = Sizes(num_lines=2000, max_tokens=64, num_adapters=4, interactive_max_tokens=32, num_quiet=80,
             concurrency=64, restart_lines=300)


# ---- the server ------------------------------------------------------------------------------------

class Server:
    """`loraplex serve` in its own process group; `kill` is a crash, `start` again comes back on a new port."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir, self.process, self.port, self.num_starts = env, log_dir, None, 0, 0

    def start(self, timeout_s: float = 1200) -> None:
        from loraplex.engine.process_lifetime import die_with_parent

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.num_starts += 1
        with open(self.log_dir / f"serve-{self.num_starts}.log", "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "loraplex.platform.cli.main", "serve", "--port", str(self.port)],
                cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent)
        wait_healthy(f"{self.url}/healthz", self.process, self.log_dir / f"serve-{self.num_starts}.log", timeout_s)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.kill()


def server_env(data_dir: Path, model_path: Path, args: argparse.Namespace, sizes: Sizes) -> dict[str, str]:
    settings = {
        "data_dir": data_dir, "model_path": model_path, "device": args.device, "random_weights": bool(args.random_weights),
        "max_num_seqs": sizes.concurrency, "batch_concurrency": sizes.concurrency, "batch_poll_interval_s": 0.2,
        "batch_lease_s": 3, "default_rpm": 0, "default_tpm": 0, "log_level": "warning", "max_model_len": 1024,
    }
    if args.device == "cpu":
        settings["kv_cache_memory_mb"] = 256
    settings.update(args.server_setting)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update({f"LORAPLEX_{name.upper()}": str(value) for name, value in settings.items()})
    return env


def body_shaped_model(tokenizer_dir: Path, shape: str, work: Path) -> Path:
    """A model folder with `tokenizer_dir`'s tokenizer, chat template and special tokens and the layer shapes of
    the published model `shape` (its vocabulary stays the tokenizer's, so every token id is in range)."""
    from loraplex.engine.cuda.random_weights import NAMED_CONFIGS

    folder = work / f"{shape}-shape"
    folder.mkdir()
    for path in tokenizer_dir.iterdir():
        if path.is_file() and not path.name.startswith(".") and path.name != "config.json" and path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    config = json.loads((tokenizer_dir / "config.json").read_text())
    body = {k: NAMED_CONFIGS[shape][k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "rms_norm_eps", "tie_word_embeddings")}
    config.update(body, rope_parameters={"rope_type": "default", "rope_theta": NAMED_CONFIGS[shape]["rope_theta"]})
    config.pop("rope_scaling", None)
    config.pop("rope_theta", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def shape_suffix(shape: str) -> str:
    """`Llama-3.1-8B` -> `_llama_3_1_8b`: the suffix of a body shape's figures in batch.json."""
    return "_" + "".join(c if c.isalnum() else "_" for c in shape.lower())


def seed_keys(database_url: str) -> dict[str, str]:
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.db import migrate
    from loraplex.platform.db.session import make_db_engine, make_session_factory

    migrate.upgrade(database_url)
    engine = make_db_engine(database_url)
    with make_session_factory(engine)() as db:
        keys = {name: store.create_api_key(db, tenant=store.create_tenant(db, name=name), scopes=scopes).key
                for name, scopes in (("batchco", [Scope.INFERENCE, Scope.ADAPTERS, Scope.USAGE]),
                                     ("chatco", [Scope.INFERENCE]))}
    engine.dispose()
    return keys


def upload_adapters(server: Server, key: str, model_path: Path, model: str, num: int, work: Path) -> list[str]:
    from loraplex.adapters.base_model import BaseModelSpec
    from loraplex.adapters.random_adapters import write_random_adapter

    spec = BaseModelSpec.from_hf_config(json.loads((model_path / "config.json").read_text()), name=model)
    names = []
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as http:
        for i in range(num):
            folder = write_random_adapter(work / f"adapter-{i}", spec, seed=i)
            files = [("file", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
            created = http.post("/v1/adapters", data={"name": f"bench-{i}"}, files=files)
            created.raise_for_status()
            while (info := http.get(f"/v1/adapters/{created.json()['id']}").json())["status"] == "validating":
                time.sleep(0.2)
            if info["status"] != "ready":
                raise SystemExit(f"adapter bench-{i} failed validation: {info['reason']}")
            names.append(info["name"])
    return names


# ---- the work --------------------------------------------------------------------------------------

def lines_for(tag: str, num: int, models: list[str], max_tokens: int) -> list[dict[str, Any]]:
    return [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": models[i % len(models)], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"[{tag} {i}] {QUESTIONS[i % len(QUESTIONS)]}"}]}}
            for i in range(num)]


def submit(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait(client: openai.OpenAI, batch_id: str, *, until: Any = None, timeout_s: float = 7200) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL or (until is not None and until(batch)):
            return batch
        time.sleep(0.2)
    raise SystemExit(f"batch {batch_id} did not end in {timeout_s} s")


def outputs_of(client: openai.OpenAI, batch: Any) -> dict[str, dict[str, Any]]:
    """Each custom_id's first result line, with how many lines it had (`copies`) across both files."""
    found: dict[str, dict[str, Any]] = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        for line in client.files.content(file_id).text.splitlines() if file_id else []:
            item = json.loads(line)
            first = found.setdefault(item["custom_id"], item)
            first["copies"] = first.get("copies", 0) + 1
    return found


def run_batch(client: openai.OpenAI, lines: list[dict[str, Any]], max_tokens: int) -> tuple[float, dict[str, str]]:
    """Seconds from create to completed, and each line's answer (every line checked: 200, max_tokens tokens)."""
    start = time.perf_counter()
    batch = wait(client, submit(client, lines).id)
    wall = time.perf_counter() - start
    if batch.status != "completed" or batch.request_counts.failed:
        raise SystemExit(f"batch did not complete cleanly: {batch}")
    answers = {}
    for custom_id, item in outputs_of(client, batch).items():
        body = item["response"]["body"] if item["response"] else None
        if item["response"] is None or item["response"]["status_code"] != 200 or \
                body["usage"]["completion_tokens"] != max_tokens:
            raise SystemExit(f"line {custom_id} is not a full answer: {item}")
        answers[custom_id] = body["choices"][0]["message"]["content"]
    if len(answers) != len(lines):
        raise SystemExit(f"{len(lines) - len(answers)} lines missing from the output")
    return wall, answers


def interactive(client: openai.OpenAI, model: str, max_tokens: int, *, count: int | None = None,
                stop: threading.Event | None = None) -> list[float]:
    """Latencies of requests sent one after another (`count` of them, or until `stop` is set)."""
    latencies: list[float] = []
    i = 0
    while (count is None or i < count) and not (stop is not None and stop.is_set()):
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"Interactive question {i}: {QUESTIONS[i % len(QUESTIONS)]}"}])
        latencies.append(time.perf_counter() - start)
        if reply.usage.completion_tokens != max_tokens:
            raise SystemExit(f"interactive reply of {reply.usage.completion_tokens} tokens, not {max_tokens}")
        i += 1
    return latencies


async def online(base_url: str, key: str, lines: list[dict[str, Any]], concurrency: int, max_tokens: int
                 ) -> tuple[float, dict[str, str]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=3600)
    slots = asyncio.Semaphore(concurrency)
    answers: dict[str, str] = {}

    async def one(line: dict[str, Any]) -> None:
        async with slots:
            body = dict(line["body"])
            extra = {"ignore_eos": body.pop("ignore_eos")}
            reply = await client.chat.completions.create(**body, extra_body=extra)
        if reply.usage.completion_tokens != max_tokens:
            raise SystemExit(f"online reply of {reply.usage.completion_tokens} tokens, not {max_tokens}")
        answers[line["custom_id"]] = reply.choices[0].message.content

    start = time.perf_counter()
    await asyncio.gather(*(one(line) for line in lines))
    wall = time.perf_counter() - start
    await client.close()
    return wall, answers


def phase(name: str) -> None:
    """Marks a phase's start on stderr (a profiler attached to the server can window its samples by these)."""
    print(f"[phase] {name} {time.time():.3f}", file=sys.stderr, flush=True)


# The engine's step counters on /metrics that explain a phase's latency: steps by how they ran (graph or eager)
# and, under overlapped scheduling, whether the host ran ahead of the device or why it waited; on CUDA the GPU
# time of the forward passes by kind and padded rows (the steps timed beside it).
STEP_COUNTERS = {"loraplex_engine_steps_total": ("kind",), "loraplex_engine_overlap_steps_total": ("outcome",),
                 "loraplex_engine_step_gpu_seconds_total": ("kind", "rows"),
                 "loraplex_engine_timed_steps_total": ("kind", "rows")}


def step_counters(server_url: str) -> dict[str, float]:
    """The server's engine step counters now, as `family:label` -> count (the time under `seconds`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server_url + "/metrics", timeout=60).text
    counts = {"seconds": time.perf_counter()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = STEP_COUNTERS.get(sample.name)
            if labels is not None:
                key = ":".join(sample.labels[label] for label in labels)
                counts[f"{sample.name.removesuffix('_total')}:{key}"] = sample.value
    return counts


def phase_steps(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the engine's steps did in a phase: each counter's increase, and the mean step's milliseconds."""
    out = {k: v - before.get(k, 0.0) for k, v in after.items() if k != "seconds" and v - before.get(k, 0.0)}
    steps = sum(v for k, v in out.items() if k.startswith("loraplex_engine_steps:"))
    out["seconds"] = after["seconds"] - before["seconds"]
    if steps:
        out["mean_step_ms"] = 1000 * out["seconds"] / steps
    timed = "loraplex_engine_timed_steps:"
    gpu_ms = {key.removeprefix(timed): 1000 * out.get("loraplex_engine_step_gpu_seconds:" + key.removeprefix(timed),
                                                      0.0) / count
              for key, count in out.items() if key.startswith(timed)}
    if gpu_ms:
        out["mean_gpu_ms_by_kind_and_rows"] = dict(sorted(gpu_ms.items()))
    return out


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]


def restart_check(server: Server, key: str, models: list[str], sizes: Sizes) -> int:
    """Kill the server a third of the way into a batch, restart it: lost + duplicated lines and ledger rows."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=600)
    lines = lines_for("restart", sizes.restart_lines, models, sizes.max_tokens)
    batch = submit(client, lines)
    wait(client, batch.id, until=lambda b: b.request_counts.completed >= sizes.restart_lines // 3)
    server.kill()
    server.start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=600)
    done = wait(client, batch.id)
    found = outputs_of(client, done)
    wanted = {line["custom_id"] for line in lines}
    bad = len(wanted - set(found)) + sum(item["copies"] - 1 for item in found.values())
    bad += sum(1 for item in found.values() if not item["response"] or item["response"]["status_code"] != 200)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        deadline = time.monotonic() + 120
        while True:
            rows = [r for r in http.get("/v1/usage/requests", params={"limit": 1000}).json()["data"]
                    if r["request_id"].startswith(batch.id + "-")]
            if len(rows) >= len(wanted) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    billed = {row["request_id"] for row in rows}
    return bad + abs(len(wanted) - len(billed))


# ---- the run ---------------------------------------------------------------------------------------

def measure(args: argparse.Namespace) -> dict[str, Any]:
    from loraplex.engine.model.default_model import ensure_default_model

    sizes = QUICK if args.quick else FULL
    model_path = (args.random_weights or ensure_default_model(ROOT / "data" / "models")).resolve()
    work = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    if args.body_shape:
        model_path = body_shaped_model(model_path, args.body_shape, work)
    model = model_path.name
    keys = seed_keys(f"sqlite:///{work / 'loraplex.db'}")
    server = Server(server_env(work, model_path, args, sizes), work)
    server.start()
    try:
        adapters = upload_adapters(server, keys["batchco"], model_path, model, sizes.num_adapters, work)
        models = [model, *adapters]
        batch_client = openai.OpenAI(base_url=server.url + "/v1", api_key=keys["batchco"], max_retries=0, timeout=600)
        chat_client = openai.OpenAI(base_url=server.url + "/v1", api_key=keys["chatco"], max_retries=0, timeout=600)
        interactive(chat_client, model, sizes.interactive_max_tokens, count=2)  # warm-up
        phase("quiet")
        counters = {"quiet": step_counters(server.url)}
        quiet = interactive(chat_client, model, sizes.interactive_max_tokens, count=sizes.num_quiet)
        counters["quiet_end"] = step_counters(server.url)

        # One batch of every model at full concurrency first, untimed: the first use of an adapter's shapes
        # compiles kernels and captures graphs, which the timed phases would otherwise pay in turn.
        if not args.quick:  # the quick mode's figures are not recorded: its paths are what it checks
            run_batch(batch_client, lines_for("warm", sizes.concurrency, models, sizes.max_tokens), sizes.max_tokens)
        phase("alone")
        counters["alone"] = step_counters(server.url)
        alone_s, alone_answers = run_batch(batch_client, lines_for("alone", sizes.num_lines, models, sizes.max_tokens),
                                           sizes.max_tokens)
        counters["alone_end"] = step_counters(server.url)

        stop = threading.Event()
        loaded: list[float] = []
        worker = threading.Thread(target=lambda: loaded.extend(
            interactive(chat_client, model, sizes.interactive_max_tokens, stop=stop)))
        worker.start()
        phase("mixed")
        counters["mixed"] = step_counters(server.url)
        with_s, _ = run_batch(batch_client, lines_for("mixed", sizes.num_lines, models, sizes.max_tokens),
                              sizes.max_tokens)
        counters["mixed_end"] = step_counters(server.url)
        stop.set()
        worker.join()

        online_lines = lines_for("alone", sizes.num_lines, models, sizes.max_tokens)
        phase("online")
        online_s, online_answers = asyncio.run(online(server.url + "/v1", keys["batchco"], online_lines,
                                                      sizes.concurrency, sizes.max_tokens))
        # The quick mode leaves the restart out: the suite's restart test (tests/batches/test_batch_restart.py) runs
        # the same kill-and-come-back on PostgreSQL every time, and a second server start is a fifth of a quick run.
        # --skip-restart: for comparing settings, whose figures do not need the restart's second server start.
        skip = args.quick or args.skip_restart
        lost_or_duplicated = None if skip else restart_check(server, keys["batchco"], models, sizes)
    finally:
        server.stop()
    shutil.rmtree(work, ignore_errors=True)  # kept (with the server's logs) when the run failed

    batch_tokens = sizes.num_lines * sizes.max_tokens
    equal = sum(online_answers[k] == v for k, v in alone_answers.items()) / len(alone_answers)
    metrics = {
        "interactive_p95_ratio_under_batch": p95(loaded) / p95(quiet),
        "total_throughput_ratio_with_batch":
            (batch_tokens + len(loaded) * sizes.interactive_max_tokens) / with_s / (batch_tokens / alone_s),
        "batch_over_online_throughput": (batch_tokens / alone_s) / (batch_tokens / online_s),
        **({} if lost_or_duplicated is None else {"lost_or_duplicated_on_restart": lost_or_duplicated}),
        "interactive_p95_quiet_s": p95(quiet), "interactive_p95_under_batch_s": p95(loaded),
        "interactive_p50_quiet_s": statistics.median(quiet), "interactive_p50_under_batch_s": statistics.median(loaded),
        "interactive_requests_under_batch": len(loaded),
        "batch_alone_tokens_per_s": batch_tokens / alone_s, "batch_with_interactive_s": with_s,
        "online_tokens_per_s": batch_tokens / online_s, "greedy_equal_fraction": equal,
    }
    steps = {name: phase_steps(counters[name], counters[f"{name}_end"]) for name in ("quiet", "alone", "mixed")}
    return {"sizes": sizes, "model": model, "metrics": metrics, "steps": steps,
            "checked": lost_or_duplicated in (0, None)}


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip().lower(), value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes on the CPU; writes nothing")
    parser.add_argument("--device", default="cpu", help="the server's device: cpu or cuda")
    parser.add_argument("--random-weights", type=Path, default=None, metavar="MODEL_DIR",
                        help="serve random weights of this model folder's architecture (config + tokenizer)")
    parser.add_argument("--body-shape", choices=body_shapes(), default=None,
                        help="with --random-weights: layers in this published model's shapes, the folder's tokenizer")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: results/ on full runs)")
    parser.add_argument("--skip-restart", action="store_true",
                        help="leave the restart phase out (comparing settings); writes no restart figure")
    parser.add_argument("--server-setting", action="append", default=[], type=_setting, metavar="NAME=VALUE",
                        help="a server setting for this run (e.g. overlap_scheduling=false); repeatable")
    args = parser.parse_args()
    if args.body_shape and not args.random_weights:
        parser.error("--body-shape needs --random-weights (the folder whose tokenizer it keeps)")
    args.server_setting = dict(args.server_setting)
    run = measure(args)
    metrics = run["metrics"]
    for name, value in metrics.items():
        print(f"{name:40s} {value:.4g}" if isinstance(value, float) else f"{name:40s} {value}")
    for name, steps in run["steps"].items():
        counts = {k: v for k, v in steps.items() if isinstance(v, float)
                  and not k.startswith(("loraplex_engine_timed_steps:", "loraplex_engine_step_gpu_seconds:"))}
        print(f"steps {name}: " + ", ".join(f"{k.split(':')[-1]} {v:.4g}" for k, v in counts.items()))
        for shape, ms in steps.get("mean_gpu_ms_by_kind_and_rows", {}).items():
            print(f"  GPU ms a step, {shape}: {ms:.3f}")
    if not run["checked"]:
        raise SystemExit("lines were lost or duplicated across the restart")
    out = args.out or (None if args.quick or args.skip_restart else RESULT)
    if out is None:
        return
    import torch
    from loraplex.engine.host_info import cpu_benchmark_machine

    machine = cpu_benchmark_machine()
    machine["gpu"] = torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else None
    sizes: Sizes = run["sizes"]
    result = {
        "benchmark": "batch",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine,
        "config": {"model": run["model"], "weights": "random" if args.random_weights else "bundled",
                   "device": args.device, **sizes.__dict__, "server_settings": args.server_setting,
                   "tokens": "generated (output) tokens"},
        "metrics": metrics,
        "engine_steps_by_phase": run["steps"],
        "targets": {"interactive_p95_ratio_under_batch": {"op": "<=", "value": 1.5},
                    "total_throughput_ratio_with_batch": {"op": ">=", "value": 0.9},
                    "batch_over_online_throughput": {"op": ">=", "value": 0.9},
                    "lost_or_duplicated_on_restart": {"op": "==", "value": 0}},
        "checked": run["checked"],
    }
    if args.body_shape and args.out is None:
        result = beside_main_figures(result, args.body_shape)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def body_shapes() -> list[str]:
    from loraplex.engine.cuda.random_weights import NAMED_CONFIGS

    return sorted(NAMED_CONFIGS)


def beside_main_figures(result: dict[str, Any], shape: str) -> dict[str, Any]:
    """batch.json with this body-shape run's figures added under their suffix (the main figures kept), its date,
    machine and settings under config.body_shapes."""
    main = json.loads(RESULT.read_text())
    suffix = shape_suffix(shape)
    main["metrics"] = {k: v for k, v in main["metrics"].items() if not k.endswith(suffix)}
    main["metrics"].update({f"{k}{suffix}": v for k, v in result["metrics"].items()})
    main["config"].setdefault("body_shapes", {})[shape] = {
        "date": result["date"], "machine": result["machine"], "config": result["config"],
        "engine_steps_by_phase": result.get("engine_steps_by_phase")}
    main["checked"] = main["checked"] and result["checked"]
    return main


if __name__ == "__main__":
    main()
