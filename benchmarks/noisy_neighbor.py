"""Noisy neighbour: one tenant's latency while another tenant attacks the same server (CPU).

A real `loraplex serve` runs as a subprocess (SmolLM2-135M-Instruct on the
CPU, SQLite). A victim tenant sends small chat requests steadily, one at a
time; its latency is measured in alternating quiet and attacked phases
(the baseline is the p95 over every quiet phase, all measured in this run,
interleaved so that other load on the machine weighs on both alike):

- `stop_strings`: completions with 4,000 stop strings, ignore_eos and 96
  tokens to generate, back to back (the server's stop-sequence limit is
  raised to 4,000 for this run, so the matcher itself is under attack);
  `plain_generation`, the same requests without stop strings, is measured
  as a control: the share of the engine any long request of another tenant
  takes (on this CPU a second sequence in the batch costs the victim too);
- `big_body`: three clients sending 80 MB JSON bodies without an API key,
  each as fast as the socket takes it, two bodies a second per client;
- `upload_bomb`: adapter uploads of a 200 KB tar.gz whose long-name header
  declares 200 MB, alternating with a zip of 100,000 empty entries.

Every output is checked before it is timed: each victim reply is a 200 with
text; the stop-string requests end by length having generated every token;
the 80 MB bodies get 401 and the bombs 400 (their messages checked).

    python benchmarks/noisy_neighbor.py          # full: writes benchmarks/results/noisy_neighbor.json
    python benchmarks/noisy_neighbor.py --quick  # small sizes; writes nothing
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
from contextlib import contextmanager
from datetime import UTC
from pathlib import Path

import httpx
from loraplex.engine.host_info import cpu_benchmark_machine

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "noisy_neighbor.json"
MODEL = "SmolLM2-135M-Instruct"
BIG_BODY_BYTES = 80 * 1024 * 1024
NUM_STOP_STRINGS = 4000
TARGET_RATIO = 1.5
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
def serve(data_dir: Path) -> Iterator[tuple[str, dict[str, str]]]:
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
        deadline = time.monotonic() + 900
        while True:
            if process.poll() is not None:
                raise RuntimeError("the server exited:\n" + (data_dir / "server.log").read_text()[-4000:])
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy")
            time.sleep(0.2)
        yield url, keys
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


# ---- the attacks ------------------------------------------------------------------------------

def stop_strings_attack(url: str, key: str, stopped: threading.Event, max_tokens: int,
                        num_stops: int = NUM_STOP_STRINGS) -> int:
    """`num_stops=0` is the control: the same generation without stop strings, the share of the engine any
    tenant's long request takes."""
    rng = random.Random(0)
    stops = ["".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(12, 32)))
             for _ in range(num_stops)]
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


def big_body_attack(url: str, _key: str, stopped: threading.Event) -> int:
    host, port = url.removeprefix("http://").split(":")
    chunk = b"a" * (1024 * 1024)
    num_sent = 0
    while not stopped.is_set():
        # Paced at 2 bodies a second per client: the attacker runs on the same two cores as the server here,
        # and a tighter loop would measure its own kernel copies (on the old server one body took ~3 s).
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


def upload_bomb_attack(url: str, key: str, stopped: threading.Event, bombs: list[tuple[str, bytes, str]]) -> int:
    num_sent = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
        while not stopped.is_set():
            name, data, expected = bombs[num_sent % len(bombs)]
            reply = client.post("/v1/adapters", data={"name": f"bomb-{num_sent}"},
                                files={"file": (name, data, "application/octet-stream")})
            if reply.status_code != 400 or expected not in reply.json()["error"]["message"]:
                raise RuntimeError(f"upload bomb {name} not refused: {reply.status_code} {reply.text[:300]}")
            num_sent += 1
    return num_sent


# ---- measurement ------------------------------------------------------------------------------

def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[94]


def summary(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_s": statistics.median(values), "p95_s": cuts[94], "p99_s": cuts[98]}


def under_attack(url: str, keys: dict[str, str], attack: Callable[..., int], num_attackers: int,
                 num_requests: int) -> tuple[list[float], int]:
    stopped = threading.Event()
    results: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(attack(url, keys["attacker"], stopped))
        except BaseException as exc:  # reported below: a failed check invalidates the run
            errors.append(exc)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(num_attackers)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the attack is under way before the victim is timed
    latencies = victim_latencies(url, keys["victim"], num_requests)
    stopped.set()
    for thread in threads:
        thread.join(timeout=600)
    if errors:
        raise errors[0]
    return latencies, sum(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; writes nothing")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a killed run still stops its server
    num_rounds, num_requests = (1, 6) if args.quick else (2, 10)
    max_tokens = 32 if args.quick else 96
    bombs = [("bomb.tar.gz", tar_long_name_bomb(), "extended header")]
    if not args.quick:
        bombs.append(("bomb.zip", zip_many_entries(), "more than"))
    attacks: dict[str, tuple[Callable[..., int], int]] = {
        "plain_generation": (lambda u, k, s: stop_strings_attack(u, k, s, max_tokens, num_stops=0), 1),
        "stop_strings": (lambda u, k, s: stop_strings_attack(u, k, s, max_tokens), 1),
        "big_body": (big_body_attack, 3),
        "upload_bomb": (lambda u, k, s: upload_bomb_attack(u, k, s, bombs), 2),
    }
    quiet: list[float] = []
    attacked: dict[str, list[float]] = {name: [] for name in attacks}
    num_attacks = dict.fromkeys(attacks, 0)
    with tempfile.TemporaryDirectory(prefix="noisy-neighbor-") as tmp, serve(Path(tmp)) as (url, keys):
        progress(f"server up at {url}")
        warm_up = victim_latencies(url, keys["victim"], 5)  # prefix cache, first-request costs
        progress(f"warm-up latencies {[round(x, 2) for x in warm_up]}")
        # Quiet and attacked phases alternate, so a change in the machine's other load hits both alike.
        for round_index in range(num_rounds):
            for name, (attack, num_attackers) in attacks.items():
                quiet += victim_latencies(url, keys["victim"], num_requests)
                latencies, count = under_attack(url, keys, attack, num_attackers, num_requests)
                attacked[name] += latencies
                num_attacks[name] += count
                progress(f"round {round_index + 1} {name}: p95 {p95(latencies):.3f} s quiet p95 {p95(quiet):.3f} s")
    quiet_p95 = p95(quiet)
    metrics: dict[str, float] = {f"victim_quiet_{k}": v for k, v in summary(quiet).items()}
    for name, latencies in attacked.items():
        for stat, value in summary(latencies).items():
            metrics[f"victim_{name}_{stat}"] = value
        metrics[f"num_attack_requests_{name}"] = num_attacks[name]
        metrics[f"victim_p95_ratio_{name}"] = metrics[f"victim_{name}_p95_s"] / quiet_p95
    metrics["victim_p95_ratio_worst"] = max(metrics[f"victim_p95_ratio_{name}"] for name in attacks
                                            if name not in CONTROLS)
    for name, value in metrics.items():
        print(f"{name:<44}{value:>12.3f}" if isinstance(value, float) else f"{name:<44}{value:>12}")
    if args.quick:
        return
    result = {
        "benchmark": "noisy_neighbor",
        "date": datetime.datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": MODEL, "server": "loraplex serve subprocess, CPU, SQLite",
                   "victim": "chat, 8 tokens, one at a time, 50 ms apart",
                   "phases": f"{num_rounds} rounds of (quiet, attacked) x {num_requests} victim requests per attack",
                   "stop_strings": f"{NUM_STOP_STRINGS} stop strings, ignore_eos, {max_tokens} tokens, 1 client",
                   "plain_generation": f"control: the same without stop strings ({max_tokens} tokens, 1 client)",
                   "big_body": "80 MB JSON without an API key, 3 clients, 2 bodies/s each",
                   "upload_bomb": "tar.gz with a 200 MB long-name header / zip of 100,000 entries, 2 clients",
                   "baseline": "p95 of every quiet phase, each run just before an attacked one"},
        "metrics": metrics,
        "targets": {f"victim_p95_ratio_{name}": {"op": "<=", "value": TARGET_RATIO}
                    for name in [*attacks, "worst"] if name not in CONTROLS},
        "checked": True,
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
