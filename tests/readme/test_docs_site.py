"""The docs site builds with `mkdocs build --strict` (what `make docs` runs), and the built pages carry
what the generators put in: every setting, every benchmark, the diagrams."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from readme_examples import REPO_ROOT


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([str(Path(sys.executable).with_name("mkdocs")), "build", "--strict", "--quiet",
                            "--site-dir", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_make_docs_builds_strictly() -> None:
    dry = subprocess.run(["make", "-n", "-o", ".venv/.loraplex-docs-installed", "docs"], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "mkdocs build --strict" in dry, dry


def test_every_setting_is_on_the_built_configuration_page(site: Path) -> None:
    from loraplex.platform.settings import Settings

    page = (site / "configuration" / "index.html").read_text()
    missing = [name for name in Settings.model_fields if f"LORAPLEX_{name.upper()}" not in page]
    assert not missing, f"settings missing from the built configuration page: {missing}"


def test_generated_parts_are_filled_in_everywhere(site: Path) -> None:
    for page in site.rglob("*.html"):
        assert "generated:" not in page.read_text(), f"{page}: a generated block was left unfilled"
    assert (site / "benchmarks" / "index.html").read_text().count("<table>") >= 10
    assert (site / "architecture" / "index.html").read_text().count('class="mermaid"') == 3
