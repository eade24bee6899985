"""A relative data directory (the `./data` default of `make serve`) must work end to end.

Uploads used to fail under `make serve`: blobs were linked into a temporary folder with their relative
path, and a link resolves a relative target against its own folder, so every link dangled. These tests run
from a fresh working directory with the default settings, and record every symlink the code makes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from loraplex.adapters.archive import UploadLimits
from loraplex.adapters.models import AdapterStatus
from loraplex.adapters.registry import InMemoryAdapterRegistry
from loraplex.adapters.source import StoredAdapterSource
from loraplex.adapters.store import LocalBlobStore
from loraplex.adapters.tasks import ValidationContext, run_validation
from loraplex.platform.settings import Settings
from random_adapters import write_random_adapter


@pytest.fixture
def symlink_targets(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every target passed to os.symlink (Path.symlink_to goes through it); the real link is still made."""
    targets: list[str] = []
    real_symlink = os.symlink

    def recording_symlink(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        targets.append(os.fspath(src))
        return real_symlink(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "symlink", recording_symlink)
    yield targets


@pytest.fixture
def fresh_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    workdir = tmp_path / "newcomer"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    for name in ("LORAPLEX_DATA_DIR", "LORAPLEX_ADAPTER_STORAGE_DIR", "LORAPLEX_MODEL_PATH", "LORAPLEX_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    return workdir


def test_settings_paths_are_absolute_from_the_start(fresh_cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings()
    assert settings.data_dir == fresh_cwd / "data"
    assert settings.data_dir.is_absolute()
    assert settings.resolved_adapter_storage_dir == fresh_cwd / "data" / "adapters"
    assert settings.models_dir.is_absolute()
    assert settings.resolved_database_url == f"sqlite:///{fresh_cwd / 'data' / 'loraplex.db'}"

    monkeypatch.setenv("LORAPLEX_ADAPTER_STORAGE_DIR", "blobs-here")
    monkeypatch.setenv("LORAPLEX_MODEL_PATH", "models/mine")
    settings = Settings()
    assert settings.resolved_adapter_storage_dir == fresh_cwd / "blobs-here"
    assert settings.resolve_model_path() == fresh_cwd / "models" / "mine"
    # A later chdir (a worker, a daemon) must not move them.
    monkeypatch.chdir("/")
    assert settings.resolved_adapter_storage_dir == fresh_cwd / "blobs-here"


def test_upload_validates_and_loads_with_a_relative_store(
    fresh_cwd: Path, tmp_path: Path, spec, symlink_targets: list[str]
) -> None:
    source_folder = write_random_adapter(tmp_path / "upload", spec, r=4)
    store = LocalBlobStore(Path("data") / "adapters")  # relative, as a caller might still pass it
    registry = InMemoryAdapterRegistry()
    info = registry.create(
        tenant_id="t1", name="rel", description="", sha256=store.put_file(source_folder / "adapter_model.safetensors"),
        config_sha256=store.put_file(source_folder / "adapter_config.json"), size_bytes=1, base_model=None,
    )
    context = ValidationContext(
        registry=registry, store=store, spec=spec, max_rank=64, dtype=torch.float32, limits=UploadLimits(),
    )

    run_validation(info.id, context)
    validated = registry.find(info.id)
    assert validated is not None
    assert validated.status == AdapterStatus.READY, validated.reason

    weights = StoredAdapterSource(registry, store, spec, torch.float32).load(info.id)
    assert weights.rank == 4

    assert len(symlink_targets) == 4  # two links to validate, two to load
    relative = [target for target in symlink_targets if not Path(target).is_absolute()]
    assert relative == [], f"symlink targets must be absolute: {relative}"


def test_every_link_in_shipped_code_goes_through_the_absolute_helper() -> None:
    """The runtime check above covers the paths that link today; this keeps new ones from bypassing it."""
    import ast

    repo = Path(__file__).resolve().parents[2]
    offenders = []
    for folder in ("platform", "engine", "adapters", "grammar", "sessions", "billing"):
        for path in (repo / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                is_method_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                if is_method_call and node.func.attr in ("symlink_to", "symlink", "hardlink_to", "link"):
                    offenders.append(f"{path.relative_to(repo)}:{node.lineno}")
    assert offenders == ["adapters/store.py:" + str(_helper_link_line(repo))], offenders


def _helper_link_line(repo: Path) -> int:
    lines = (repo / "adapters" / "store.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "symlink_to(" in line)
