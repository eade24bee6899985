"""A non-editable install carries everything the server needs at run time: the migrations and the portal's files.

A default editable install finds these next to the source tree, so only a real wheel shows an omission.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds in the source tree's build/; leave the checkout as the test found it.
    had_build = (ROOT / "build").exists()
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
            check=True, capture_output=True, text=True, timeout=300,
        )
    finally:
        if not had_build:
            shutil.rmtree(ROOT / "build", ignore_errors=True)
    (built,) = out.glob("loraplex-*.whl")
    return built


def test_wheel_carries_migrations_and_portal_files(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    versions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("*.py"))
    assert versions, "the repository has no migrations to package"
    for name in ["loraplex/migrations/env.py", "loraplex/migrations/script.py.mako"]:
        assert name in names, f"{name} missing from the wheel"
    for version in versions:
        assert f"loraplex/migrations/versions/{version}" in names, f"migration {version} missing from the wheel"
    templates = sorted(p.name for p in (ROOT / "web" / "templates").glob("*.html"))
    for template in templates:
        assert f"loraplex/web/templates/{template}" in names, f"portal template {template} missing from the wheel"


def test_installed_wheel_finds_its_migration_chain(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    # Run from an empty folder with the installed copy first on the path: no checkout's migrations/ to fall back on.
    code = (
        "from loraplex.platform.db import migrate; "
        "d = migrate.migrations_dir(); print(d); "
        "print(migrate.head_revision('sqlite:///' + str(d.parent / 'unused.db')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    found, head = result.stdout.split()
    assert Path(found).resolve().is_relative_to(target.resolve())
    newest = sorted((ROOT / "migrations" / "versions").glob("*.py"))[-1].read_text()
    assert f'revision = "{head}"' in newest, f"installed head {head} is not the newest migration"
