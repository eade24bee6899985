"""The container deployment holds no secret of its own and runs nothing as root."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_compose_has_no_default_database_password() -> None:
    text = (REPO_ROOT / "compose.yaml").read_text()
    uses = re.findall(r"\$\{POSTGRES_PASSWORD([^}]*)\}", text)
    assert uses, "compose.yaml no longer reads POSTGRES_PASSWORD"
    assert all(use.startswith(":?") for use in uses), f"a default or optional password: {uses}"
    services = yaml.safe_load(text)["services"]
    assert "${POSTGRES_PASSWORD:?" in services["postgres"]["environment"]["POSTGRES_PASSWORD"]


def test_dockerfile_runs_as_a_non_root_user() -> None:
    lines = [line.strip() for line in (REPO_ROOT / "Dockerfile").read_text().splitlines()]
    users = [line.split(None, 1)[1] for line in lines if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, users
    cmd = max(i for i, line in enumerate(lines) if line.startswith("CMD"))
    assert max(i for i, line in enumerate(lines) if line.startswith("USER ")) < cmd
