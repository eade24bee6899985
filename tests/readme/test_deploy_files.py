"""Dockerfile, compose.yaml and .dockerignore checked against the code they name (no Docker engine here):
every command is a real CLI command or a real Celery invocation of our app, every variable a real setting,
every COPY source exists, and the production page's container commands use what compose.yaml defines."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from readme_examples import REPO_ROOT, Example, bash_commands, readme_example
from test_readme_production import CELERY_APP, cli_commands

COMPOSE = REPO_ROOT / "compose.yaml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
VARIABLE = re.compile(r"\$\{(\w+)")


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def settings_fields() -> set[str]:
    from loraplex.platform.settings import Settings

    return {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields}


def assert_runs_our_code(command: list[str]) -> None:
    """A `loraplex ...` command path that exists, or `celery ... -A <our app> worker|beat` whose options parse."""
    if command[0] == "loraplex":
        known, path = cli_commands(), ()
        for word in (w for w in command[1:] if not w.startswith("-")):
            if (*path, word) not in known:
                break
            path = (*path, word)
        assert path, f"{command}: no such loraplex command"
        assert not any(len(p) > len(path) and p[:len(path)] == path for p in known), f"{command}: a group"
        return
    assert command[0] == "celery", command
    assert command[command.index("-A") + 1] == CELERY_APP
    assert {"worker", "beat"} & set(command), command
    celery = Path(sys.executable).with_name("celery")
    # --help after every option: click rejects an unknown option or a bad value before printing help
    # (--workdir names a folder inside the container; "/" stands in for it here)
    args = ["/" if i and command[i - 1] == "--workdir" else word for i, word in enumerate(command)]
    checked = subprocess.run([str(celery), *args[1:], "--help"], cwd="/", capture_output=True, text=True,
                             timeout=120)
    assert checked.returncode == 0, checked.stderr


def test_compose_runs_server_worker_beat_postgres_redis() -> None:
    services = compose()["services"]
    assert {"server", "worker", "beat", "postgres", "redis", "migrate"} <= set(services)
    ours = {name: s for name, s in services.items() if s.get("build") == "."}
    assert set(ours) == {"server", "worker", "beat", "migrate"}
    for service in ours.values():
        assert_runs_our_code(service["command"])
    assert services["server"]["command"] == ["loraplex", "serve"]
    assert services["migrate"]["command"] == ["loraplex", "db", "upgrade"]
    assert "worker" in services["worker"]["command"] and "beat" in services["beat"]["command"]
    for name in ("server", "worker", "beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--appendonly") + 1] == "yes"   # the usage journal's durability


def test_compose_settings_are_real_and_shared() -> None:
    fields = settings_fields()
    services = compose()["services"]
    for name in ("server", "worker", "beat", "migrate"):
        env = services[name]["environment"]
        unknown = [v for v in env if v.startswith("LORAPLEX_") and v not in fields]
        assert not unknown, f"{name}: not settings: {unknown}"
        assert env["LORAPLEX_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["LORAPLEX_REDIS_URL"].startswith("redis://redis:")
    server = services["server"]["environment"]
    assert server["LORAPLEX_REPLICA_ID"] and server["LORAPLEX_DEVICE"] == "cuda"
    storage = {services[n]["environment"]["LORAPLEX_ADAPTER_STORAGE_DIR"] for n in ("server", "worker")}
    assert len(storage) == 1   # the worker validates the files the server stored: one path on one volume
    mounts = [dict(zip(("volume", "path"), v.split(":")[:2], strict=True)) for v in services["worker"]["volumes"]]
    path = storage.pop()
    assert any(path.startswith(m["path"]) and f"{m['volume']}:{m['path']}" in services["server"]["volumes"]
               for m in mounts), "server and worker must mount the adapter storage from one volume"
    from loraplex.platform.settings import Settings

    grace = float(services["server"]["stop_grace_period"].rstrip("s"))
    assert grace > Settings.model_fields["drain_timeout_s"].default


def test_dockerfile_copies_what_exists_and_runs_our_cli() -> None:
    instructions = dockerfile_instructions()
    copied = []
    for keyword, rest in instructions:
        if keyword == "COPY":
            *sources, _ = shlex.split(rest)
            copied += sources
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"COPY {source}: no such file in the repository"
    import tomllib

    package_dirs = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in {*package_dirs.values(), "migrations"}:
        assert f"{folder}/" in copied, f"the image lacks {folder}/"
    torch = next(rest for keyword, rest in instructions if keyword == "ARG" and rest.startswith("TORCH_VERSION="))
    makefile = re.search(r"^TORCH_VERSION \?= (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.M).group(1)
    assert torch == f"TORCH_VERSION={makefile}"
    workdirs = [rest for keyword, rest in instructions if keyword == "WORKDIR"]
    assert workdirs[-1] != workdirs[0], "the image must not run from its source folder (platform/ shadows stdlib)"
    env = " ".join(rest for keyword, rest in instructions if keyword == "ENV")
    assert set(re.findall(r"LORAPLEX_\w+", env)) <= settings_fields()
    cmd = next(rest for keyword, rest in instructions if keyword == "CMD")
    assert_runs_our_code(yaml.safe_load(cmd))
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".venv", "data", ".git"} <= set(ignored)


@readme_example("production-docker")
def test_readme_container_commands_match_compose(example: Example) -> None:
    services = compose()["services"]
    text = COMPOSE.read_text()
    commands = [shlex.split(c.split(" #")[0]) for c in bash_commands(example)]
    up = commands[0]
    env_vars = {w.split("=", 1)[0] for w in up if "=" in w}
    assert env_vars and env_vars <= set(VARIABLE.findall(text)), env_vars   # MODEL is what compose reads
    assert up[len(env_vars):][:4] == ["docker", "compose", "up", "-d"]
    for command in commands[1:]:
        assert command[:3] == ["docker", "compose", "exec"] and command[3] in services
        assert_runs_our_code(command[4:])


@readme_example("production-kubernetes")
def test_kubernetes_commands_match_the_manifests(example: Example) -> None:
    folder = REPO_ROOT / "deploy" / "kubernetes"
    commands = [shlex.split(c.split(" #")[0]) for c in bash_commands(example)]
    namespace = commands[0][-1]
    assert commands[0][:3] == ["kubectl", "create", "namespace"]
    secret = commands[1]
    assert secret[:7] == ["kubectl", "-n", namespace, "create", "secret", "generic", "loraplex-secrets"]
    literals = {w.split("=", 2)[1] for w in secret if w.startswith("--from-literal=")}
    example_secret = yaml.safe_load((folder / "secret.example.yaml").read_text())
    assert literals and literals <= set(example_secret["stringData"]) and literals <= settings_fields()
    manifests = [yaml.safe_load_all(p.read_text()) for p in folder.glob("*.yaml")]
    documents = [d for docs in manifests for d in docs if d]
    assert any("loraplex-secrets" in str(d) and d.get("kind") == "Deployment" for d in documents)

    apply = commands[2]
    assert apply[:4] == ["kubectl", "-n", namespace, "apply"] and apply[4] == "-k"
    kustomization = yaml.safe_load((REPO_ROOT / apply[5] / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (folder / resource).exists(), resource
    assert any(d.get("kind") == "Job" for d in documents), "the migration Job"

    exec_ = commands[3]
    assert exec_[:4] == ["kubectl", "-n", namespace, "exec"]
    kind, name = exec_[4].split("/")
    assert kind == "deploy" and any(d.get("kind") == "Deployment" and d["metadata"]["name"] == name for d in documents), exec_[4]
    assert_runs_our_code(exec_[exec_.index("--") + 1:])
    assert (folder / "config.yaml").exists() and (REPO_ROOT / "deploy" / "haproxy" / "run.sh").exists()
