"""Noisy neighbour: one tenant's latency while another tenant attacks the same server (CPU).

A real `loraplex serve` runs as a subprocess (SmolLM2-135M-Instruct on the
CPU, SQLite). A victim tenant sends small chat requests steadily, one at a
time, from its own client process; each attack runs in another client
process (at nice 10: on a real deployment the attacker's client has its own
machine), so neither client's work lands in the other's timings. The
victim's latency is measured in alternating quiet and attacked phases (the
baseline is the p95 over every quiet phase of this run; each attacked phase
follows a quiet one, so a change in the machine's other load weighs on both
alike); the spread is the lowest and highest per-round ratio.

- `stop_strings`: completions with 4,000 stop strings, ignore_eos and 96
  tokens to generate, back to back (the server's stop-sequence limit is
  raised to 4,000 for this run, so the matcher itself is under attack);
  `plain_generation`, the same requests without stop strings, is measured
  as a control: what any long request of another tenant costs;
- `big_body`: three clients sending 80 MB JSON bodies without an API key,
  each as fast as the socket takes it, two bodies a second per client;
- `upload_bomb`: adapter uploads of a 200 KB tar.gz whose long-name header
  declares 200 MB, alternating with a zip of 100,000 empty entries;
- `prompt_list`: completions whose `prompt` is a list of 3,000 prompts;
- `many_tools`: chat requests with 20,000 tiny tools;
- `deep_schema`: chat requests whose json_schema nests 400 levels deep;
- `logit_bias`: chat requests biasing the whole vocabulary with n=8;
- `poison_parameters`: chat requests with numbers the engine cannot
  represent (top_k and seed past int64, NaN temperature, stop token ids,
  min_tokens and a reasoning budget past 2^64, an infinite repetition
  penalty), each to be refused with a 400 naming it;
- `flood_long_streams`: 100 concurrent streams of 400 tokens, read normally,
  each replaced as it ends (quick: 24 of 64);
- `wide_choices`: 6 concurrent streams asking for 16 choices each (the
  default `max_n`) of 48 tokens, each replaced as it ends: 96 choices
  against the engine's 64 slots (quick: 3 of 24 tokens);
- `never_read_streams`: 280 streaming requests of 400 tokens whose answers
  are never read, held open (quick: 40), more than the server's 256
  admission places.
The four refused attacks and the poison come from two clients, each sending
5 requests a second (10 a second together: the default per-key rate limit
of 600 a minute). The server runs on its default settings (fair sharing on,
no per-tenant in-flight cap) but for rate limits off.

Every output is checked before it is timed: each victim reply is a 200 with
text; the stop-string requests end by length having generated every token;
the 80 MB bodies get 401, the bombs 400 (their messages checked), and the
last four a 400 naming the parameter. The issue's suite bound is checked
too (victim p95 within 3x quiet or +1 s, server memory bounded): `--quick`
fails when an attack breaks it.

    python benchmarks/noisy_neighbor.py          # full: writes benchmarks/results/noisy_neighbor.json
    python benchmarks/noisy_neighbor.py --quick  # small sizes; writes nothing; fails past the suite bound
    python benchmarks/noisy_neighbor.py --attacks flood_long_streams,batch_job --merge   # rerun some attacks
        # into the results file; config.attack_dates says which run each attack's figures come from
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import io
import json
import os
import random
import signal
import socket
import statistics
import string
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import UTC
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import psutil
from loraplex.engine.host_info import cpu_benchmark_machine

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is loaded
from serve_health import wait_healthy

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "noisy_neighbor.json"
MODEL = "SmolLM2-135M-Instruct"
BIG_BODY_BYTES = 80 * 1024 * 1024
NUM_STOP_STRINGS = 4000
TARGET_RATIO = 1.5
SUITE_RATIO, SUITE_EXTRA_S = 3.0, 1.0  # the suite's bound: within 3x quiet p95, or +1 s, whichever is larger
# Each client of a refused-request attack sends one request per 0.2 s: its two clients together send 10 a
# second, the default per-key rate limit of valid requests (600 a minute). A request refused for its content
# is not counted against that limit, so a faster flood is possible; it costs the server the HTTP reading (and
# the scan) of each body, and here its own client's copies on the same two cores. Not measured.
REFUSED_PACE_S = 0.2
MAX_SERVER_GROWTH_MB = 1024            # the server's memory may grow this much under any attack, no more
CONTROLS = ("plain_generation",)  # not an attack: what an ordinary long request of another tenant costs


# ---- the server -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def seed_keys(database_url: str) -> dict[str, str]:
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.db import migrate
    from loraplex.platform.db.session import make_db_engine, make_session_factory

    migrate.upgrade(database_url)
    db_engine = make_db_engine(database_url)
    with make_session_factory(db_engine)() as db:
        victim = store.create_tenant(db, name="victim")
        attacker = store.create_tenant(db, name="attacker")
        keys = {
            "victim": store.create_api_key(db, tenant=victim, scopes=[Scope.INFERENCE]).key,
            "attacker": store.create_api_key(db, tenant=attacker, scopes=[Scope.INFERENCE, Scope.ADAPTERS]).key,
        }
    db_engine.dispose()
    return keys


@contextmanager
def serve(data_dir: Path) -> Iterator[tuple[str, dict[str, str], int]]:
    from loraplex.engine.model.default_model import ensure_default_model

    model_path = ensure_default_model(ROOT / "data" / "models")
    database_url = f"sqlite:///{data_dir / 'loraplex.db'}"
    keys = seed_keys(database_url)
    env = {name: value for name, value in os.environ.items() if not name.startswith("LORAPLEX_")}
    env.update({
        "LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_DATABASE_URL": database_url,
        "LORAPLEX_MODEL_PATH": str(model_path), "LORAPLEX_DEVICE": "cpu", "LORAPLEX_KV_CACHE_MEMORY_MB": "64",
        "LORAPLEX_DEFAULT_RPM": "0", "LORAPLEX_DEFAULT_TPM": "0", "LORAPLEX_LOG_LEVEL": "warning",
        "LORAPLEX_MAX_STOP_SEQUENCES": str(NUM_STOP_STRINGS),
        "OMP_NUM_THREADS": "1",  # one intra-op thread: spinning OpenMP threads on a shared 2-core box cost more
    })
    port = free_port()
    log = (data_dir / "server.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "loraplex.platform.cli.main", "serve", "--port", str(port)],
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/healthz", process, data_dir / "server.log")
        yield url, keys, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


# ---- the victim -------------------------------------------------------------------------------

def victim_latencies(url: str, key: str, num_requests: int) -> list[float]:
    """One request at a time with a short pause between: a steady, light tenant."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
            "temperature": 0}
    latencies = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
        for _ in range(num_requests):
            start = time.perf_counter()
            reply = client.post("/v1/chat/completions", json=body)
            elapsed = time.perf_counter() - start
            if reply.status_code != 200 or not reply.json()["choices"][0]["message"]["content"]:
                raise RuntimeError(f"victim request failed: {reply.status_code} {reply.text[:300]}")
            latencies.append(elapsed)
            time.sleep(0.05)
    return latencies


# ---- the attacks: each `fn(url, key, stopped, quick) -> number of requests sent` ---------------

def stop_strings_attack(url: str, key: str, stopped: threading.Event, quick: bool,
                        num_stops: int = NUM_STOP_STRINGS) -> int:
    """`num_stops=0` is the control: the same generation without stop strings."""
    rng = random.Random(0)
    stops = ["".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(12, 32)))
             for _ in range(num_stops)]
    max_tokens = generation_tokens(quick)
    body = {"model": MODEL, "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, **({"stop": stops} if stops else {})}
    num_sent = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
        while not stopped.is_set():
            reply = client.post("/v1/completions", json=body)
            choice = reply.json()["choices"][0] if reply.status_code == 200 else None
            if choice is None or choice["finish_reason"] != "length" or reply.json()["usage"]["completion_tokens"] \
                    != max_tokens:
                raise RuntimeError(f"stop-string request not served in full: {reply.status_code} {reply.text[:300]}")
            num_sent += 1
    return num_sent


def plain_generation_attack(url: str, key: str, stopped: threading.Event, quick: bool) -> int:
    return stop_strings_attack(url, key, stopped, quick, num_stops=0)


def generation_tokens(quick: bool) -> int:
    return 48 if quick else 96


def big_body_attack(url: str, _key: str, stopped: threading.Event, _quick: bool) -> int:
    host, port = url.removeprefix("http://").split(":")
    chunk = b"a" * (1024 * 1024)
    num_sent = 0
    while not stopped.is_set():
        # Paced at 2 bodies a second per client: the attacker shares the server's two cores here, and a
        # tighter loop would measure its own kernel copies (on the old server one body took ~3 s).
        stopped.wait(0.5)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {BIG_BODY_BYTES}\r\n\r\n".encode() + b'{"model": "')
            try:
                for _ in range(BIG_BODY_BYTES // len(chunk)):
                    sock.sendall(chunk)
            except OSError:
                pass  # refused and closed before the body was through
            reply = b""
            try:
                while b"\r\n\r\n" not in reply:
                    data = sock.recv(65536)
                    if not data:
                        break
                    reply += data
            except OSError:
                pass
        if not reply.startswith(b"HTTP/1.1 401"):
            raise RuntimeError(f"80 MB body without a key not refused with 401: {reply[:200]!r}")
        num_sent += 1
    return num_sent


def tar_long_name_bomb() -> bytes:
    buf = io.BytesIO()
    size = 200 * 1024 * 1024
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9) as gz:
        info = tarfile.TarInfo("././@LongLink")
        info.size, info.type = size, tarfile.GNUTYPE_LONGNAME
        gz.write(info.tobuf(format=tarfile.GNU_FORMAT))
        zeros = b"a" * (1 << 20)
        for _ in range(size // len(zeros)):
            gz.write(zeros)
        gz.write(b"\0" * 1024)
    return buf.getvalue()


def zip_many_entries() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i in range(100_000):
            zf.writestr(str(i), b"")
    return buf.getvalue()


_BOMBS: list[tuple[str, bytes, str]] = []


def upload_bomb_attack(url: str, key: str, stopped: threading.Event, quick: bool) -> int:
    if not _BOMBS:  # built once per attacker process, before the attack is timed (see attacker_worker)
        _BOMBS.append(("bomb.tar.gz", tar_long_name_bomb(), "extended header"))
        if not quick:
            _BOMBS.append(("bomb.zip", zip_many_entries(), "more than"))
    num_sent = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
        while not stopped.is_set():
            name, data, expected = _BOMBS[num_sent % len(_BOMBS)]
            reply = client.post("/v1/adapters", data={"name": f"bomb-{num_sent}"},
                                files={"file": (name, data, "application/octet-stream")})
            if reply.status_code != 400 or expected not in reply.json()["error"]["message"]:
                raise RuntimeError(f"upload bomb {name} not refused: {reply.status_code} {reply.text[:300]}")
            num_sent += 1
    return num_sent


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def refused_bodies() -> dict[str, tuple[str, dict, str]]:
    """Attack name -> (path, body, the parameter its 400 must name): each past a limit the edge enforces."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    return {
        "prompt_list": ("/v1/completions", {"model": MODEL, "prompt": ["Say hi."] * 3000, "max_tokens": 8}, "prompt"),
        "many_tools": ("/v1/chat/completions", {**chat, "tools": [
            {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
            for i in range(20_000)]}, "tools"),
        "deep_schema": ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(400)}}}, "response_format"),
        "logit_bias": ("/v1/chat/completions", {**chat, "n": 8, "logit_bias": {str(i): 1 for i in range(49152)}},
                       "logit_bias"),
    }


POISON_BODIES: list[tuple[dict, str]] = [
    ({"top_k": 2**63, "temperature": 0.7}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"temperature": float("nan")}, "temperature"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"min_tokens": 2**64}, "min_tokens"),
    ({"max_reasoning_tokens": 2**64}, "max_reasoning_tokens"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
]


def poison_attack(url: str, key: str, stopped: threading.Event, _quick: bool) -> int:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    bodies = [(json.dumps({**chat, **fields}).encode(), param) for fields, param in POISON_BODIES]
    num_sent = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}",
                                             "Content-Type": "application/json"}, timeout=300) as client:
        while not stopped.wait(REFUSED_PACE_S):
            content, param = bodies[num_sent % len(bodies)]
            reply = client.post("/v1/chat/completions", content=content)
            error = reply.json().get("error") or {} if reply.status_code == 400 else {}
            if not str(error.get("param") or "").startswith(param):
                raise RuntimeError(f"poison {param} not refused naming it: {reply.status_code} {reply.text[:300]}")
            num_sent += 1
    return num_sent


def stream_tokens(quick: bool) -> int:
    return 64 if quick else 400


def flood_long_streams_attack(url: str, key: str, stopped: threading.Event, quick: bool) -> int:
    """Many concurrent long streams, each read as it comes and replaced when it ends."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": stream_tokens(quick), "ignore_eos": True, "temperature": 0.8, "stream": True}
    return stream_flood(url, key, stopped, 24 if quick else 100, body)


def wide_choices_attack(url: str, key: str, stopped: threading.Event, quick: bool) -> int:
    """Concurrent streams of the most choices a request may ask for (`n` 16, the default `max_n`), each replaced
    when it ends: together more choices than the engine's slots, each request's forked from one prompt (48 tokens:
    the most a request of 16 choices may ask for in this server's KV pool)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour and say why you like it."}],
            "max_tokens": 24 if quick else 48, "ignore_eos": True, "temperature": 0.8, "n": 16, "stream": True}
    return stream_flood(url, key, stopped, 3 if quick else 6, body)


def stream_flood(url: str, key: str, stopped: threading.Event, num_streams: int, body: dict[str, Any]) -> int:
    """`num_streams` concurrent streams of `body`, each read as it comes and sent again when it ends, until
    `stopped`; the requests sent (a refusal is an error)."""
    counts: list[int] = []
    errors: list[BaseException] = []

    def stream_loop() -> None:
        sent = 0
        try:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
                while not stopped.is_set():
                    with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                        if reply.status_code != 200:
                            raise RuntimeError(f"flood stream refused: {reply.status_code} {reply.read()[:300]!r}")
                        for _ in reply.iter_lines():
                            if stopped.is_set():
                                break
                    sent += 1
        except BaseException as exc:
            errors.append(exc)
        counts.append(sent)

    threads = [threading.Thread(target=stream_loop, daemon=True) for _ in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    if errors:
        raise errors[0]
    return sum(counts)


def never_read_streams_attack(url: str, key: str, stopped: threading.Event, quick: bool) -> int:
    """Streaming requests sent on raw sockets whose answers are never read while the attack lasts; past the
    server's admission places the rest must be refused (429), checked once the attack ends."""
    num_streams = 40 if quick else 280
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                       "max_tokens": stream_tokens(quick), "ignore_eos": True, "stream": True}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    sockets = []
    try:
        for _ in range(num_streams):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes stall
            sock.sendall(request)
            sockets.append(sock)
        stopped.wait()
        statuses = []
        for sock in sockets:
            head = sock.recv(64)
            statuses.append(head.split(b" ")[1] if head.startswith(b"HTTP/1.1 ") else head[:20])
        unexpected = [s for s in statuses if s not in (b"200", b"429")]
        if unexpected:
            raise RuntimeError(f"never-read streams answered {unexpected[:5]}")
    finally:
        for sock in sockets:
            with suppress(OSError):
                sock.close()
    return len(sockets)


BATCH_STOPPED = frozenset({"cancelled", "completed", "failed", "expired"})
BATCH_STOP_TIMEOUT_S = 600


def batch_job_attack(url: str, key: str, stopped: threading.Event, quick: bool, *,
                     under_way: threading.Event | None = None) -> int:
    """A Batch API job of long lines running while the victim is timed: batch work is the engine's lowest class,
    run on what interactive requests leave. `under_way` is set once its first line is done (the batch then runs
    at its full concurrency); cancelled once the attack ends, and awaited until it has stopped: a cancel lets the
    lines in flight finish (as OpenAI's does), and they must not run into the next phase. Lines are a quarter of
    a flood stream's length, so that those finish within a minute or two on the CPU. Answers the lines it
    finished."""
    num_lines = 40 if quick else 400
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": stream_tokens(quick) // 4, "ignore_eos": True, "temperature": 0.8,
                       "messages": [{"role": "user", "content": f"Write a long story about lighthouse {i}."}]}}
             for i in range(num_lines)]
    jsonl = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("lines.jsonl", jsonl)})
        if uploaded.status_code != 200:
            raise RuntimeError(f"batch file refused: {uploaded.status_code} {uploaded.text[:300]}")
        created = client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "completion_window": "24h",
                                                   "endpoint": "/v1/chat/completions"})
        if created.status_code != 200:
            raise RuntimeError(f"batch refused: {created.status_code} {created.text[:300]}")
        batch_id = created.json()["id"]
        while not stopped.wait(0.2):
            if client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] >= 1:
                break
        if under_way is not None:
            under_way.set()
        stopped.wait()
        client.post(f"/v1/batches/{batch_id}/cancel")
        deadline = time.monotonic() + BATCH_STOP_TIMEOUT_S
        while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] not in BATCH_STOPPED:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cancelled batch is still {batch['status']} after {BATCH_STOP_TIMEOUT_S} s")
            time.sleep(1.0)
    return int(batch["request_counts"]["completed"])


def refused_attack(name: str) -> Callable[..., int]:
    def attack(url: str, key: str, stopped: threading.Event, _quick: bool) -> int:
        path, body, param = refused_bodies()[name]
        content = json.dumps(body).encode()
        num_sent = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}",
                                                 "Content-Type": "application/json"}, timeout=300) as client:
            while not stopped.wait(REFUSED_PACE_S):
                reply = client.post(path, content=content)
                error = reply.json().get("error") or {} if reply.status_code == 400 else {}
                if not str(error.get("param") or "").startswith(param):
                    raise RuntimeError(f"{name} not refused naming {param}: {reply.status_code} {reply.text[:300]}")
                num_sent += 1
        return num_sent
    return attack


# name -> (attack, number of attacking clients, what it is)
ATTACKS: dict[str, tuple[Callable[..., int], int, str]] = {
    "plain_generation": (plain_generation_attack, 1, "control: the stop_strings requests without stop strings"),
    "stop_strings": (stop_strings_attack, 1, f"{NUM_STOP_STRINGS} stop strings, ignore_eos, back to back"),
    "big_body": (big_body_attack, 3, "80 MB JSON without an API key, 2 bodies/s per client"),
    "upload_bomb": (upload_bomb_attack, 2, "tar.gz with a 200 MB long-name header / zip of 100,000 entries"),
    "prompt_list": (refused_attack("prompt_list"), 2, "completions with a list of 3,000 prompts"),
    "many_tools": (refused_attack("many_tools"), 2, "chat with 20,000 tools"),
    "deep_schema": (refused_attack("deep_schema"), 2, "json_schema nested 400 levels"),
    "logit_bias": (refused_attack("logit_bias"), 2, "logit_bias over the whole vocabulary, n=8"),
    "poison_parameters": (poison_attack, 2, "numbers past what the engine represents, each a 400 naming it"),
    "flood_long_streams": (flood_long_streams_attack, 1, "100 concurrent 400-token streams, read normally"),
    "wide_choices": (wide_choices_attack, 1, "6 concurrent 48-token streams of n=16 choices, read normally"),
    "never_read_streams": (never_read_streams_attack, 1, "280 400-token streams never read, held open"),
    "batch_job": (batch_job_attack, 1, "a Batch API job of 400 lines of 100 tokens running"),
}


# Attacks that take a while to get going say when they are (the victim is timed from then on).
SIGNALS_UNDER_WAY = frozenset({"batch_job"})


# ---- client processes ----------------------------------------------------------------------------

def victim_worker(conn: Connection, url: str, key: str) -> None:
    """Its own process: each message is a number of requests; the answer their latencies (or an error)."""
    while (num_requests := conn.recv()) is not None:
        try:
            conn.send(victim_latencies(url, key, num_requests))
        except Exception as exc:  # reported by the parent: a failed check invalidates the run
            conn.send(exc)


def attacker_worker(conn: Connection, url: str, key: str, quick: bool) -> None:
    """Its own process: runs the named attack from 'start' until 'stop'; answers the requests sent.

    At nice 10: the attacking client shares this machine's cores with the server, and its own work (building,
    sending and reading requests as fast as it can) would otherwise be counted as the server's; a real attacker's
    client runs on its own machine."""
    os.nice(10)
    while (name := conn.recv()) is not None:
        if name == "upload_bomb":
            built = threading.Event()
            built.set()
            upload_bomb_attack(url, key, built, quick)  # builds the bombs now, outside the timed phase
        conn.send(run_attack(conn, name, url, key, quick))


def run_attack(conn: Connection, name: str, url: str, key: str, quick: bool) -> int | BaseException:
    attack, num_clients, _ = ATTACKS[name]
    stopped = threading.Event()
    counts: list[int] = []
    errors: list[BaseException] = []

    under_way = threading.Event()
    signals = name in SIGNALS_UNDER_WAY

    def run() -> None:
        try:
            counts.append(attack(url, key, stopped, quick, under_way=under_way) if signals
                          else attack(url, key, stopped, quick))
        except BaseException as exc:
            errors.append(exc)
        finally:
            under_way.set()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    if signals:
        under_way.wait(timeout=600)
    conn.send("started")
    conn.recv()  # "stop"
    stopped.set()
    for thread in threads:
        thread.join(timeout=600)
    return errors[0] if errors else sum(counts)


class Client:
    """A client process and its end of the pipe."""

    def __init__(self, target: Callable[..., None], *args: object) -> None:
        self.conn, child = get_context("spawn").Pipe()
        self.process = get_context("spawn").Process(target=target, args=(child, *args), daemon=True)
        self.process.start()

    def ask(self, message: object) -> object:
        self.conn.send(message)
        answer = self.conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        """Ends the process; one cut short in the middle of a phase (the run was stopped) is killed."""
        self.conn.send(None)
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()


# ---- measurement ------------------------------------------------------------------------------

def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[94]


def summary(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_s": statistics.median(values), "p95_s": cuts[94], "p99_s": cuts[98]}


class MemoryWatch:
    """Peak resident memory (MB) of the server's process tree, sampled every 0.2 s while `watching`."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak_mb = 0.0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def rss_mb(self) -> float:
        total = 0
        for process in [self.root, *self.root.children(recursive=True)]:
            with suppress(psutil.Error):
                total += process.memory_info().rss
        return total / 2**20

    def reset(self) -> float:
        self.peak_mb = self.rss_mb()
        return self.peak_mb

    def _run(self) -> None:
        while not self.stopped.wait(0.2):
            self.peak_mb = max(self.peak_mb, self.rss_mb())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; writes nothing")
    parser.add_argument("--attacks", default=",".join(ATTACKS),
                        help="comma-separated attacks to run (default: all; a subset writes nothing unless --merge)")
    parser.add_argument("--merge", action="store_true",
                        help="with a subset of --attacks: replace those attacks' figures in the results file, each "
                             "with its own quiet baseline from this run, and keep the others (their run's date "
                             "is kept per attack in config.attack_dates)")
    args = parser.parse_args()
    chosen = [name for name in args.attacks.split(",") if name]
    unknown = sorted(set(chosen) - set(ATTACKS))
    if unknown:
        parser.error(f"unknown attacks {unknown}; known: {list(ATTACKS)}")
    partial = set(chosen) != set(ATTACKS)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a killed run still stops its server
    # quick: 3 victim requests a phase, so that the suite's run of every attack stays near a minute
    num_rounds, num_requests = (1, 3) if args.quick else (3, 10)
    quiet: list[float] = []
    attacked: dict[str, list[float]] = {name: [] for name in chosen}
    round_ratios: dict[str, list[float]] = {name: [] for name in chosen}
    num_attacks = dict.fromkeys(chosen, 0)
    growth_mb = dict.fromkeys(chosen, 0.0)
    with tempfile.TemporaryDirectory(prefix="noisy-neighbor-") as tmp, serve(Path(tmp)) as (url, keys, pid):
        progress(f"server up at {url}")
        victim = Client(victim_worker, url, keys["victim"])
        attacker = Client(attacker_worker, url, keys["attacker"], args.quick)
        memory = MemoryWatch(pid)
        try:
            warm_up = victim.ask(5)  # prefix cache, first-request costs
            progress(f"warm-up latencies {[round(x, 2) for x in warm_up]}")
            # Quiet and attacked phases alternate, so a change in the machine's other load hits both alike.
            for round_index in range(num_rounds):
                for name in chosen:
                    before = victim.ask(num_requests)
                    quiet += before
                    baseline_mb = memory.reset()
                    attacker.ask(name)
                    time.sleep(1.0)  # the attack is under way before the victim is timed
                    latencies = victim.ask(num_requests)
                    num_attacks[name] += attacker.ask("stop")
                    growth_mb[name] = max(growth_mb[name], memory.peak_mb - baseline_mb)
                    attacked[name] += latencies
                    round_ratios[name].append(p95(latencies) / p95(before))
                    progress(f"round {round_index + 1} {name}: p95 {p95(latencies):.3f} s, quiet before "
                             f"{p95(before):.3f} s, all quiet {p95(quiet):.3f} s; server +{growth_mb[name]:.0f} MB")
        finally:
            memory.stopped.set()
            victim.close()
            attacker.close()
    quiet_p95 = p95(quiet)
    metrics: dict[str, float] = {f"victim_quiet_{k}": v for k, v in summary(quiet).items()}
    broken = []
    for name, latencies in attacked.items():
        for stat, value in summary(latencies).items():
            metrics[f"victim_{name}_{stat}"] = value
        metrics[f"num_attack_requests_{name}"] = num_attacks[name]
        metrics[f"victim_p95_ratio_{name}"] = metrics[f"victim_{name}_p95_s"] / quiet_p95
        metrics[f"victim_p95_ratio_{name}_round_min"] = min(round_ratios[name])
        metrics[f"victim_p95_ratio_{name}_round_max"] = max(round_ratios[name])
        metrics[f"server_memory_growth_mb_{name}"] = growth_mb[name]
        if metrics[f"victim_{name}_p95_s"] > max(SUITE_RATIO * quiet_p95, quiet_p95 + SUITE_EXTRA_S):
            broken.append(f"{name}: victim p95 {metrics[f'victim_{name}_p95_s']:.2f} s against quiet {quiet_p95:.2f} s")
        if growth_mb[name] > MAX_SERVER_GROWTH_MB:
            broken.append(f"{name}: the server grew by {growth_mb[name]:.0f} MB")
    metrics["victim_p95_ratio_worst"] = max((metrics[f"victim_p95_ratio_{name}"] for name in chosen
                                             if name not in CONTROLS), default=0.0)
    for name, value in metrics.items():
        print(f"{name:<52}{value:>12.3f}" if isinstance(value, float) else f"{name:<52}{value:>12}")
    if broken:
        print("suite bound broken: " + "; ".join(broken))
        if args.quick:
            sys.exit(1)
    if args.quick or (partial and not args.merge):
        return
    if partial:
        merge_into_results(chosen, metrics, quiet_p95)
        return
    result = {
        "benchmark": "noisy_neighbor",
        "date": datetime.datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": MODEL, "server": "loraplex serve subprocess, CPU, SQLite, default settings "
                   f"but rpm/tpm off and {NUM_STOP_STRINGS} stop strings allowed",
                   "clients": "victim and attacker each in their own process; the attacker's at nice 10",
                   "victim": "chat, 8 tokens, one at a time, 50 ms apart",
                   "phases": f"{num_rounds} rounds of (quiet, attacked) x {num_requests} victim requests per attack",
                   "generation_tokens": generation_tokens(args.quick),
                   **{name: f"{what}, {clients} client(s)" for name, (_, clients, what) in ATTACKS.items()},
                   "baseline": "p95 of every quiet phase, each run just before an attacked one",
                   "spread": "victim_p95_ratio_<attack>_round_min/_max: each round's attacked p95 over the "
                             "quiet phase just before it",
                   "suite_bound": f"victim p95 <= max({SUITE_RATIO}x quiet, quiet + {SUITE_EXTRA_S} s), server "
                                  f"growth <= {MAX_SERVER_GROWTH_MB} MB: {'broken: ' + '; '.join(broken) if broken else 'held'}"},
        "metrics": metrics,
        "targets": {f"victim_p95_ratio_{name}": {"op": "<=", "value": TARGET_RATIO}
                    for name in [*ATTACKS, "worst"] if name not in CONTROLS},
        "checked": True,
    }
    result["config"]["attack_dates"] = dict.fromkeys(ATTACKS, result["date"])
    keep_gpu_figures(result)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


def keep_gpu_figures(result: dict[str, Any]) -> None:
    """A full CPU run rewrites the file but keeps the GPU flood figures (benchmarks/noisy_neighbor_gpu.py writes
    them, on a lent GPU) with their own date, machine and targets."""
    if not RESULT.exists():
        return
    old = json.loads(RESULT.read_text())
    result["metrics"].update({k: v for k, v in old.get("metrics", {}).items() if k.startswith("gpu_flood_")})
    result["targets"].update({k: v for k, v in old.get("targets", {}).items() if k.startswith("gpu_flood_")})
    if "gpu_flood" in old.get("config", {}):
        result["config"]["gpu_flood"] = old["config"]["gpu_flood"]


def merge_into_results(chosen: list[str], metrics: dict[str, float], quiet_p95: float) -> None:
    """The chosen attacks' figures replace theirs in the results file (each attack's ratio is over the quiet
    phases of its own run); the file's date becomes this run's, and config.attack_dates says which run each
    attack's figures come from."""
    result = json.loads(RESULT.read_text())
    old_date = result["date"]
    now = datetime.datetime.now(UTC).isoformat(timespec="seconds")
    dates = result["config"].setdefault("attack_dates", {})
    for name in ATTACKS:
        dates.setdefault(name, old_date)
    kept = {k: v for k, v in result["metrics"].items()
            if not any(k.startswith(f"victim_{n}_") or k.endswith(f"_{n}") or f"_{n}_round_" in k for n in chosen)}
    kept.update({k: v for k, v in metrics.items() if k != "victim_p95_ratio_worst" and not k.startswith("victim_quiet_")})
    for name in chosen:
        dates[name] = now
        kept[f"victim_quiet_p95_s_run_of_{name}"] = quiet_p95
    kept["victim_p95_ratio_worst"] = max(v for k, v in kept.items() if k.startswith("victim_p95_ratio_")
                                         and k.removeprefix("victim_p95_ratio_") in ATTACKS
                                         and k.removeprefix("victim_p95_ratio_") not in CONTROLS)
    result["metrics"] = kept
    result["date"] = now
    result["machine"] = cpu_benchmark_machine()
    gpu_targets = {k: v for k, v in result["targets"].items() if k.startswith("gpu_flood_")}  # the GPU run's own
    result["targets"] = {f"victim_p95_ratio_{name}": {"op": "<=", "value": TARGET_RATIO}
                         for name in [*ATTACKS, "worst"] if name not in CONTROLS} | gpu_targets
    for name, (_, clients, what) in ATTACKS.items():
        result["config"].setdefault(name, f"{what}, {clients} client(s)")
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"merged {', '.join(chosen)} into {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
