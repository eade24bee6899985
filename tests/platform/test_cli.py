"""The `loraplex` CLI against a real SQLite database (and the help texts a newcomer reads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from loraplex.platform.auth.keys import hash_api_key
from loraplex.platform.cli.main import app
from loraplex.platform.db.models import ApiKey
from loraplex.platform.db.session import make_db_engine, make_session_factory
from typer.testing import CliRunner


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("LORAPLEX_DATABASE_URL", raising=False)
    return CliRunner()


def run(cli: CliRunner, *args: str, code: int = 0) -> str:
    result = cli.invoke(app, list(args))
    assert result.exit_code == code, result.output
    return result.output


def test_help_lists_every_command(cli: CliRunner) -> None:
    text = run(cli, "--help")
    for command in ("serve", "db", "tenants", "keys"):
        assert command in text
    assert "--demo" in run(cli, "serve", "--help")
    assert "--scopes" in run(cli, "keys", "create", "--help")


def test_db_upgrade_current_downgrade(cli: CliRunner) -> None:
    assert "database at revision" in run(cli, "db", "upgrade")
    current = run(cli, "db", "current")
    head = current.split("head:")[1].strip()
    assert current.split("current:")[1].split()[0] == head
    assert "base" in run(cli, "db", "downgrade", "base", "--yes")
    assert "base (empty)" in run(cli, "db", "current")


def test_tenants_and_keys(cli: CliRunner, tmp_path: Path) -> None:
    assert "created tenant acme" in run(cli, "tenants", "create", "acme")
    assert "already exists" in run(cli, "tenants", "create", "acme", code=1)
    assert "acme" in run(cli, "tenants", "list")

    output = run(cli, "keys", "create", "--tenant", "acme", "--scopes", "inference,usage", "--name", "ci")
    key = output.strip().splitlines()[-1]
    assert key.startswith("lpx_")
    engine = make_db_engine(f"sqlite:///{tmp_path / 'loraplex.db'}")
    with make_session_factory(engine)() as db:
        record = db.query(ApiKey).one()
    engine.dispose()
    assert record.key_hash == hash_api_key(key) and record.scopes == "inference usage"

    listing = run(cli, "keys", "list", "--tenant", "acme")
    assert record.id in listing and key not in listing and "never" in listing
    assert f"revoked {record.id}" in run(cli, "keys", "revoke", record.id)
    assert "no key" in run(cli, "keys", "revoke", "key_missing", code=1)
    assert "unknown scope" in run(cli, "keys", "create", "--tenant", "acme", "--scopes", "root", code=2)
    assert "no tenant" in run(cli, "keys", "create", "--tenant", "nobody", code=1)


def test_demo_key_is_created_once(cli: CliRunner, tmp_path: Path) -> None:
    from loraplex.platform.cli.serve import ensure_demo_key
    from loraplex.platform.settings import Settings

    settings = Settings(data_dir=tmp_path)
    first = ensure_demo_key(settings)
    assert first is not None and first.startswith("lpx_")
    assert ensure_demo_key(settings) is None  # shown once; never again
    assert "demo" in run(cli, "tenants", "list")


def test_cli_commands_start_without_the_engine_stack() -> None:
    """Operators' commands (tenants, keys, prices, usage, adapters) talk to the database or the API: importing
    torch, transformers and the grammar backends made each one take seconds before doing anything."""
    heavy = ("torch", "transformers", "llguidance", "xgrammar", "fastapi")
    done = subprocess.run([sys.executable, "-P", "-c", "import sys; from loraplex.platform.cli.main import app; "
                           f"print(sorted(m for m in {heavy!r} if m in sys.modules))"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
