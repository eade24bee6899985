"""The README stays executable and complete: every code block is run by a named test, every setting has a
row in the Configuration table, and the text speaks to users and operators of this project only."""

from __future__ import annotations

import re
from pathlib import Path

from configuration_table import documented_variables
from readme_examples import README, REPO_ROOT, Example, covered_names, parse_examples, readme_example

TEST_FILES = sorted((REPO_ROOT / "tests" / "readme").glob("test_*.py")) + sorted(
    (REPO_ROOT / "tests" / "browser").glob("test_*.py"))
# Variables the README documents that are read outside Settings, and the file that reads each.
READ_OUTSIDE_SETTINGS = {"LORAPLEX_CPU_PAGED_DECODE": "engine/kernels/cpu_paged_decode.py"}


def test_every_readme_block_is_named_and_run_by_a_test() -> None:
    examples = parse_examples(README.read_text())
    unnamed = [f"README.md:{e.line} ({e.lang or 'text'})" for e in examples if e.name is None]
    assert not unnamed, (
        f"code blocks without a `<!-- example: NAME -->` line above them: {unnamed}. Name each, and add a test "
        "decorated @readme_example(NAME) in tests/readme/ that runs it (see tests/readme/readme_examples.py)")
    names = [e.name for e in examples]
    assert len(names) == len(set(names)), f"example names used twice: {sorted(n for n in names if names.count(n) > 1)}"
    covered = covered_names(TEST_FILES)
    untested = sorted(set(names) - set(covered))
    assert not untested, f"README examples no test runs: {untested} (add @readme_example(NAME) tests)"
    gone = sorted(set(covered) - set(names))
    assert not gone, f"tests name README examples that no longer exist: { {n: covered[n] for n in gone} }"


def test_parser_sees_markers_and_fences() -> None:
    text = "x\n<!-- example: one -->\n\n```bash\necho 1\n```\n```\nplain\n```\n"
    one, plain = parse_examples(text)
    assert (one.name, one.lang, one.text, one.line) == ("one", "bash", "echo 1\n", 4)
    assert (plain.name, plain.lang, plain.text) == (None, "", "plain\n")


def test_every_setting_has_a_row_in_the_configuration_table() -> None:
    from loraplex.platform.settings import Settings

    documented = documented_variables(README)
    variables = {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields}
    missing = sorted(variables - set(documented))
    assert not missing, f"settings without a row in README's Configuration table: {missing}"
    stale = sorted(set(documented) - variables - set(READ_OUTSIDE_SETTINGS))
    assert not stale, f"Configuration rows naming no setting: {stale}"
    for variable, path in READ_OUTSIDE_SETTINGS.items():
        assert variable in (REPO_ROOT / path).read_text(), f"{variable} is no longer read by {path}"


def test_configuration_defaults_match_the_settings() -> None:
    """Where a row gives a plain literal default, it is the field's default (paths and URLs are described)."""
    from loraplex.platform.settings import Settings

    for variable, default in documented_variables(README).items():
        field = Settings.model_fields.get(variable.removeprefix("LORAPLEX_").lower())
        literal = re.fullmatch(r"`([^`<>]*)`", default)
        if field is None or literal is None or field.default is None:
            continue
        value, written = field.default, literal.group(1)
        if isinstance(value, Path):
            assert Path(written) == value, f"{variable}: README says {written}, Settings has {value}"
            continue
        expected = str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) \
            else str(value)
        assert written == expected, f"{variable}: README says {written}, Settings has {value!r}"


def test_readme_speaks_to_users_and_operators_only() -> None:
    text = README.read_text()
    assert not re.search(r"\bissues? ?#?\d+", text, re.IGNORECASE), "the README cites an issue number"
    assert "device tool" not in text.lower()
    for target in re.findall(r"\]\(([^)]+)\)|`(\.\./[^`]+)`", text):
        link = next(t for t in target if t)
        assert not link.startswith(("../", "/")), f"the README points outside the repository: {link}"
        if not re.match(r"[a-z]+://", link):
            assert (REPO_ROOT / link.split("#")[0]).exists(), f"the README links to a missing file: {link}"
    assert not re.search(r"(?<![\w.])\.\./", text), "the README names a path outside the repository"


def test_code_and_tests_cite_no_issue_numbers_or_internal_tools() -> None:
    pattern = re.compile(r"issue ?#?[0-9]|device tool", re.IGNORECASE)
    offenders = []
    for folder in ("platform", "engine", "adapters", "grammar", "sessions", "billing", "benchmarks", "tests",
                   "migrations"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line) and path != Path(__file__):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}")
    for path in (REPO_ROOT / "pyproject.toml", REPO_ROOT / "Makefile"):
        if pattern.search(path.read_text()):
            offenders.append(path.name)
    assert not offenders, f"issue numbers or internal tool names cited in code: {offenders}"


@readme_example("architecture")
def test_architecture_sketch_names_real_parts(example: Example) -> None:
    from loraplex.engine.async_engine import AsyncEngine

    assert "engine.AsyncEngine" in example.text and AsyncEngine.__name__ == "AsyncEngine"
    for part in ("platform (FastAPI)", "billing ledger", "openai SDK"):
        assert part in example.text
    for folder in ("platform", "engine", "billing"):
        assert (REPO_ROOT / folder).is_dir()
