"""The package layout: `platform/` never shadows the stdlib, every folder is packaged, every module imports."""

from __future__ import annotations

import importlib
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("platform", "engine", "adapters", "grammar", "sessions", "billing")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_folders() -> dict[str, Path]:
    """loraplex.X.Y -> folder, for every folder under the code folders that holds .py files."""
    folders: dict[str, Path] = {}
    for top in CODE_FOLDERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            folder = path.parent
            if "__pycache__" in folder.parts:
                continue
            relative = folder.relative_to(ROOT)
            folders[".".join(("loraplex", *relative.parts))] = folder
    return folders


def _modules() -> list[str]:
    names = []
    for package, folder in _package_folders().items():
        for path in sorted(folder.glob("*.py")):
            names.append(package if path.stem == "__init__" else f"{package}.{path.stem}")
    return names


def test_stdlib_platform_is_not_shadowed_from_repo_root() -> None:
    code = "import platform, sys; print(platform.__file__); print(platform.python_version())"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    module_file, version = result.stdout.split()
    assert Path(module_file).resolve().parent == Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert version == ".".join(map(str, sys.version_info[:3]))


def test_no_init_in_top_level_folders() -> None:
    for top in CODE_FOLDERS:
        assert not (ROOT / top / "__init__.py").exists(), f"{top}/__init__.py would make it a top-level package"


def test_every_code_folder_is_listed_in_packages() -> None:
    declared = set(_pyproject()["tool"]["setuptools"]["packages"])
    missing = sorted(set(_package_folders()) - declared)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_every_subpackage_has_init() -> None:
    for package, folder in _package_folders().items():
        if folder.parent != ROOT:
            assert (folder / "__init__.py").is_file(), f"{package} ({folder}) needs an __init__.py"


@pytest.mark.parametrize("module", _modules())
def test_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_no_test_module_imports_from_conftest() -> None:
    """Each test folder has a conftest.py and pytest names every one of them `conftest`, so `from conftest import`
    gets whichever loaded last: it passes alone and fails in the full run. Shared helpers live in plain modules."""
    offenders = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").rglob("*.py"))
                 if any(line.startswith(("from conftest import", "import conftest"))
                        for line in path.read_text().splitlines())]
    assert offenders == []


def _python_files(folder: str) -> list[Path]:
    return [path for path in sorted((ROOT / folder).rglob("*.py")) if "__pycache__" not in path.parts]


def test_tests_never_edit_sys_path() -> None:
    """Helper modules import by name through pytest's `pythonpath` (pyproject.toml), not per-file path edits."""
    offenders = [str(path.relative_to(ROOT)) for path in _python_files("tests")
                 if path != Path(__file__).resolve() and "sys.path.insert" in path.read_text()]
    assert offenders == []


def test_benchmarks_import_nothing_from_tests() -> None:
    """What a benchmark shares with the tests lives in the package or in benchmarks/."""
    helpers = {path.stem for path in _python_files("tests") if not path.stem.startswith(("test_", "conftest"))}
    offenders = []
    for path in _python_files("benchmarks"):
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from") and words[1].split(".")[0] in helpers - {
                    path.stem for path in _python_files("benchmarks")}:
                offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
            if "sys.path" in line and "tests" in line:
                offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert offenders == []
