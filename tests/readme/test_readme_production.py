"""The docs page "Running in production", run as far as this machine allows: the PostgreSQL + Redis + Celery
block for real (migrate, serve, an upload that waits for a worker, the worker, beat), the GPU target as a
dry run of the Makefile, and the container files checked against the code they name."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from local_serving import free_port
from make_serve import CONVERTED_MODEL, newcomer_env, prepare_checkout
from readme_examples import REPO_ROOT, BashSession, Example, bash_commands, readme_example
from waiting import wait_until

CELERY_APP = "loraplex.platform.celery_app:celery"
REDIS_FOR_README = "redis://127.0.0.1:6379/12"   # a database of its own: the Celery queue is not prefixed


def cli_commands() -> set[tuple[str, ...]]:
    """Every command path of the `loraplex` CLI, e.g. ("tenants", "create")."""
    import typer
    from loraplex.platform.cli.main import app

    paths: set[tuple[str, ...]] = set()

    def walk(command: Any, prefix: tuple[str, ...]) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            paths.add((*prefix, name))
            walk(sub, (*prefix, name))

    walk(typer.main.get_command(app), ())
    return paths


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def wait_while_running(check: Callable[[], Any], what: str, process: subprocess.Popen[bytes], log: Path,
                       timeout_s: float = 600) -> Any:
    """wait_until `check` holds, failing at once if `process` exits; an HTTP error means not yet."""
    def checked() -> Any:
        if process.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            return check()
        except httpx.HTTPError:
            return None

    return wait_until(checked, timeout_s=timeout_s, interval_s=0.3, what=lambda: f"{what}:\n{log.read_text()[-4000:]}")


@pytest.fixture
def production_env(tmp_path: Path, new_postgres_database: Any) -> Iterator[tuple[Path, dict[str, str], dict[str, str]]]:
    """A checkout, the operator's environment (a free port), and what the block's hosts and paths stand for."""
    checkout = prepare_checkout(tmp_path / "checkout")
    data_dir = tmp_path / "var-lib-loraplex"
    (data_dir / "models").mkdir(parents=True)
    (data_dir / "models" / CONVERTED_MODEL.name).symlink_to(CONVERTED_MODEL)   # no second GGUF conversion
    client = redis.Redis.from_url(REDIS_FOR_README)
    client.delete("celery")   # messages an aborted earlier run left in the queue
    env = {**newcomer_env(), "LORAPLEX_PORT": str(free_port()),
           "LORAPLEX_REDIS_KEY_PREFIX": f"lpxtest-readme-{os.getpid()}:", "LORAPLEX_KV_CACHE_MEMORY_MB": "64"}
    with new_postgres_database("loraplex_readme") as database_url:
        yield checkout, env, {
            "postgresql+psycopg://loraplex@db.internal:5432/loraplex": database_url,
            "redis://redis.internal:6379/0": REDIS_FOR_README,
            "/mnt/shared/loraplex-adapters": str(tmp_path / "shared-adapters"),
            "/var/lib/loraplex": str(data_dir),
        }
    for key in client.scan_iter(match=env["LORAPLEX_REDIS_KEY_PREFIX"] + "*"):
        client.delete(key)
    client.close()



@readme_example("production-services")
def test_postgres_redis_server_worker_and_beat_as_written(
    example: Example, production_env: tuple[Path, dict[str, str], dict[str, str]],
    trained_adapters: dict[str, Path],
) -> None:
    checkout, env, values = production_env
    shell = BashSession(checkout, env, values)
    commands = bash_commands(example)
    background = [c for c in commands if " serve" in c or " worker" in c or " beat" in c]
    assert len(background) == 3, commands
    for command in commands:
        if command not in background:
            shell.run(command)                                   # the exports and `db upgrade`
    url = f"http://127.0.0.1:{env['LORAPLEX_PORT']}"
    processes: list[subprocess.Popen[bytes]] = []
    try:
        server_log = checkout / "serve.log"
        processes.append(server := shell.start(background[0], server_log))
        wait_while_running(lambda: httpx.get(url + "/healthz", timeout=2).status_code == 200, "serve", server, server_log)
        shell.run(".venv/bin/loraplex tenants create acme")
        key = shell.run(".venv/bin/loraplex keys create --tenant acme --scopes inference,adapters").stdout.strip()
        headers = {"Authorization": f"Bearer {key}"}
        folder = trained_adapters["pirate"]
        files = [("file", (n, (folder / n).read_bytes())) for n in ("adapter_config.json", "adapter_model.safetensors")]
        created = httpx.post(url + "/v1/adapters", data={"name": "pirate"}, files=files, headers=headers, timeout=60)
        assert created.status_code == 202 and created.json()["status"] == "validating", created.text
        adapter_url = f"{url}/v1/adapters/{created.json()['id']}"
        time.sleep(3)
        assert httpx.get(adapter_url, headers=headers).json()["status"] == "validating"   # no worker yet
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200 and "celery" in str(ready.json().get("notes", {})).lower(), ready.text

        worker_log = checkout / "worker.log"
        processes.append(worker := shell.start(background[1], worker_log))
        status = wait_while_running(
            lambda: (s := httpx.get(adapter_url, headers=headers).json()["status"]) != "validating" and s,
            "validation by the worker", worker, worker_log)
        assert status == "ready", worker_log.read_text()[-3000:]
        assert "loraplex.adapters.validate" in worker_log.read_text()
        answer = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "pirate", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0}).json()
        assert answer["choices"][0]["message"]["content"].startswith("Arr"), answer

        beat_log = checkout / "beat.log"
        processes.append(beat := shell.start(background[2], beat_log))
        wait_while_running(lambda: "Starting..." in beat_log.read_text(), "celery beat", beat, beat_log, timeout_s=120)
        # the replica id the block gave the server names it in the session records it keeps
        session = httpx.post(url + "/v1/sessions", json={"model": "SmolLM2-135M-Instruct"}, headers=headers).json()
        turn = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "session_id": session["id"]})
        assert turn.status_code == 200, turn.text
        record = httpx.get(f"{url}/v1/sessions/{session['id']}", headers=headers).json()
        assert record["replica_id"] == "gpu-0", record
    finally:
        for process in reversed(processes):
            stop(process)
    assert all(p.returncode is not None for p in processes)


@readme_example("production-gpu")
def test_make_serve_gpu_installs_cuda_torch_apart_and_serves_on_the_gpu(example: Example, tmp_path: Path) -> None:
    (command,) = bash_commands(example)
    words = shlex.split(command)
    at = words.index("make")
    assert words[at + 1] == "serve-gpu", command
    env_vars = dict(w.split("=", 1) for w in words[:at])
    make_vars = [w for w in words[at + 2:] if "=" in w]
    from loraplex.platform.settings import Settings

    assert env_vars and all(name.removeprefix("LORAPLEX_").lower() in Settings.model_fields for name in env_vars)
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    dry = subprocess.run(["make", "-n", "serve-gpu", *make_vars], cwd=tmp_path, env={**newcomer_env(), **env_vars},
                         capture_output=True, text=True, check=True).stdout
    torch_version = re.search(r"^TORCH_VERSION \?= (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.M).group(1)
    assert f".venv-gpu/bin/pip install  torch=={torch_version}" in dry, dry
    assert ".venv-gpu/bin/pip install -e ." in dry and "[test]" not in dry
    assert "torch.cuda.is_available()" in dry
    assert re.search(r"LORAPLEX_DEVICE=cuda LORAPLEX_PORT=8000 \.venv-gpu/bin/loraplex serve$", dry, re.M), dry


def test_serving_installs_no_test_tools_and_testing_does(tmp_path: Path) -> None:
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)

    def dry_run(target: str) -> str:
        return subprocess.run(["make", "-n", target], cwd=tmp_path, env=newcomer_env(), capture_output=True,
                              text=True, check=True).stdout

    serve = dry_run("serve")
    assert ".venv/bin/pip install -e .\n" in serve and "[test]" not in serve
    assert ".venv/bin/pip install  torch==" in serve and "--index-url" not in serve
    assert "pip install -e '.[test,docs]'" in dry_run("test")
    # A fresh machine's `make test` resolves the project once: the test install stands for the serving one too
    # (a dry run of `test` also lists the serving install, which the real run then finds done).
    test_install = dry_run(".venv/.loraplex-test-installed")
    assert test_install.count("pip install -e") == 1 and "touch .venv/.loraplex-installed" in test_install, test_install

    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=!;\[ ]", d)[0].lower() for d in project["dependencies"]}
    test_only = {re.split(r"[<>=!;\[ ]", d)[0].lower() for d in project["optional-dependencies"]["test"]}
    assert {"pytest", "playwright", "ruff", "peft", "openai"} <= test_only
    assert not runtime & {"pytest", "playwright", "ruff", "peft", "openai"}
    code = [p for folder in ("platform", "engine", "adapters", "grammar", "sessions", "billing")
            for p in (REPO_ROOT / folder).rglob("*.py")]
    for tool in ("peft", "pytest", "playwright", "openai"):
        users = [str(p.relative_to(REPO_ROOT)) for p in code
                 if re.search(rf"^\s*(import|from) {tool}\b", p.read_text(), re.M)]
        assert not users, f"{tool} is a test tool but serving code imports it: {users}"
