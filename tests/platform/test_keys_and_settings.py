"""Key material, scopes and settings."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from loraplex.platform.auth.keys import KEY_PREFIX, display_prefix, generate_api_key, hash_api_key
from loraplex.platform.auth.scopes import Scope, parse_scopes
from loraplex.platform.settings import Settings


def test_keys_are_prefixed_random_and_hashed() -> None:
    keys = {generate_api_key() for _ in range(1000)}
    assert len(keys) == 1000
    for key in list(keys)[:10]:
        assert key.startswith(KEY_PREFIX)
        # 32 random bytes in base64url = 43 characters = 256 bits (at least 128 required)
        assert len(key) - len(KEY_PREFIX) >= 43
        assert hash_api_key(key) == hashlib.sha256(key.encode()).hexdigest()
        assert display_prefix(key) == key[:12]


def test_parse_scopes() -> None:
    assert parse_scopes("inference, admin") == [Scope.INFERENCE, Scope.ADMIN]
    assert parse_scopes(["usage", "usage"]) == [Scope.USAGE]
    with pytest.raises(ValueError, match="unknown scope 'root'"):
        parse_scopes("inference,root")
    with pytest.raises(ValueError, match="at least one"):
        parse_scopes("")


def test_settings_read_the_environment_with_prefix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LORAPLEX_PORT", "9123")
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://example:6379/3")
    monkeypatch.setenv("PORT", "1")  # unprefixed variables are not ours
    settings = Settings()
    assert settings.port == 9123
    assert settings.redis_url == "redis://example:6379/3"
    assert settings.resolved_database_url == f"sqlite:///{(tmp_path / 'loraplex.db').resolve()}"
    assert settings.is_sqlite


def test_settings_defaults_work_on_one_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LORAPLEX_DATA_DIR", "LORAPLEX_DATABASE_URL", "LORAPLEX_REDIS_URL", "LORAPLEX_MODEL_PATH"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings()
    assert settings.redis_url is None and settings.model_path is None
    assert settings.resolved_database_url.endswith("data/loraplex.db")
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)


def test_engine_core_cpu_threads_default_to_one_on_cuda_and_all_cores_on_the_cpu() -> None:
    assert Settings(device="cuda").resolve_engine_cpu_threads() == 1     # the core's CPU work there is bookkeeping
    assert Settings(device="cpu").resolve_engine_cpu_threads() is None   # torch's default: every core computes
    assert Settings(device="cuda", engine_cpu_threads=4).resolve_engine_cpu_threads() == 4
    assert Settings(device="cpu", engine_cpu_threads=2).resolve_engine_cpu_threads() == 2
    with pytest.raises(ValueError):
        Settings(engine_cpu_threads=-1)


def test_overlapped_scheduling_is_a_server_setting_on_for_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.platform.wiring import engine_config

    monkeypatch.delenv("LORAPLEX_OVERLAP_SCHEDULING", raising=False)
    assert engine_config(Settings(device="cpu", dtype="float32")).resolve_overlap_scheduling() is False
    assert engine_config(Settings(device="cuda", dtype="bfloat16")).resolve_overlap_scheduling() is True
    monkeypatch.setenv("LORAPLEX_OVERLAP_SCHEDULING", "false")
    assert engine_config(Settings(device="cuda", dtype="bfloat16")).resolve_overlap_scheduling() is False
    monkeypatch.setenv("LORAPLEX_OVERLAP_SCHEDULING", "true")
    assert engine_config(Settings(device="cpu", dtype="float32")).resolve_overlap_scheduling() is True
