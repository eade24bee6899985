"""The README and the docs stay executable and complete: every code block is run by a named test, every
setting and every route is documented, and the text speaks to users and operators of this project only."""

from __future__ import annotations

import re
from pathlib import Path

from docs_site import generated
from readme_examples import README, REPO_ROOT, all_examples, covered_names, doc_pages, parse_examples

TEST_FILES = sorted((REPO_ROOT / "tests" / "readme").glob("test_*.py")) + sorted(
    (REPO_ROOT / "tests" / "browser").glob("test_*.py"))
README_MAX_BYTES = 15 * 1024
# Telling the project's history instead of its present, or pointing at the machine the docs were written on.
HISTORY = re.compile(r"\b(this|last|previous|earlier|next) round\b|\bon this box\b|\bround \d+\b", re.IGNORECASE)


def test_every_block_is_named_and_run_by_a_test() -> None:
    examples = all_examples()
    unnamed = [f"{e.source}:{e.line} ({e.lang or 'text'})" for e in examples if e.name is None]
    assert not unnamed, (
        f"code blocks without a `<!-- example: NAME -->` line above them: {unnamed}. Name each, and add a test "
        "decorated @readme_example(NAME) in tests/readme/ that runs it (see tests/readme/readme_examples.py)")
    names = [e.name for e in examples]
    assert len(names) == len(set(names)), f"example names used twice: {sorted(n for n in names if names.count(n) > 1)}"
    covered = covered_names(TEST_FILES)
    untested = sorted(set(names) - set(covered))
    assert not untested, f"examples no test runs: {untested} (add @readme_example(NAME) tests)"
    gone = sorted(set(covered) - set(names))
    assert not gone, f"tests name examples that no page has any more: { {n: covered[n] for n in gone} }"


def test_no_block_hides_from_the_parser() -> None:
    """An indented fence (inside a list or an admonition) is not seen as an example, so none may exist."""
    for page in doc_pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not re.match(r"^\s+(```|~~~)", line), f"{page.relative_to(REPO_ROOT)}:{number}: an indented fence"
            assert not line.startswith("~~~"), f"{page.relative_to(REPO_ROOT)}:{number}: use ``` fences"


def test_parser_sees_markers_and_fences() -> None:
    text = "x\n<!-- example: one -->\n\n```bash\necho 1\n```\n```\nplain\n```\n"
    one, plain = parse_examples(text, "docs/x.md")
    assert (one.name, one.lang, one.text, one.line, one.source) == ("one", "bash", "echo 1\n", 4, "docs/x.md")
    assert (plain.name, plain.lang, plain.text) == (None, "", "plain\n")


def test_readme_is_short_with_a_table_of_contents() -> None:
    text = README.read_text()
    assert len(text.encode()) <= README_MAX_BYTES, f"README.md is {len(text.encode())} bytes (at most {README_MAX_BYTES})"
    headings = re.findall(r"^## (.+)$", text, re.M)
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    anchors = re.findall(r"\]\(#([^)]+)\)", contents)
    assert anchors == [slug(h) for h in headings if h != "Contents"], (anchors, headings)
    for command in ("make serve", "make test", "from openai import OpenAI", "make docs"):
        assert command in text
    for page in sorted((REPO_ROOT / "docs").glob("*.md")):
        if page.name != "index.md":
            assert f"](docs/{page.name})" in text, f"the README's Read on table does not link docs/{page.name}"


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).strip().replace(" ", "-")


def test_pages_speak_to_users_and_operators_only() -> None:
    for page in doc_pages():
        text, name = page.read_text(), page.relative_to(REPO_ROOT)
        assert not re.search(r"\bissues? ?#?\d+", text, re.IGNORECASE), f"{name} cites an issue number"
        assert "device tool" not in text.lower(), name
        assert not HISTORY.search(text), f"{name} tells history: {HISTORY.search(text).group(0)!r}"
        assert not re.search(r"(?<![\w.])\.\./", text), f"{name} names a path outside the repository"
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|#", target):
                continue
            assert not target.startswith("/"), f"{name} links to an absolute path: {target}"
            assert (page.parent / target.split("#")[0]).exists(), f"{name} links to a missing file: {target}"


def test_generated_benchmark_page_tells_no_history() -> None:
    rendered = generated().results_table().markdown()
    assert not HISTORY.search(rendered), f"a benchmark's method tells history: {HISTORY.search(rendered).group(0)!r}"


def test_every_setting_is_on_the_configuration_page() -> None:
    from loraplex.platform.settings import Settings

    hook = generated()
    rows = [row for section in hook.settings_rows(Settings).values() for row in section]
    variables = [row["variable"] for row in rows]
    assert len(variables) == len(set(variables)), "a setting is listed twice"
    expected = {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields}
    outside = hook.described_sections().get(hook.OUTSIDE_SETTINGS, {})
    assert set(variables) == expected | set(outside)
    undescribed = [row["variable"] for row in rows if not row["description"].strip()]
    assert not undescribed, f"settings with no description (docs/hooks/settings.yml or a comment): {undescribed}"
    for variable, entry in outside.items():
        assert variable in (REPO_ROOT / entry["read_by"]).read_text(), f"{variable} is no longer read by {entry['read_by']}"
    assert "<!-- generated: settings -->" in (REPO_ROOT / "docs" / "configuration.md").read_text()


def test_settings_descriptions_name_only_real_settings() -> None:
    from loraplex.platform.settings import Settings

    hook = generated()
    for section, described in hook.described_sections().items():
        if section != hook.OUTSIDE_SETTINGS:
            unknown = sorted(set(described) - set(Settings.model_fields))
            assert not unknown, f"docs/hooks/settings.yml ({section}) describes settings Settings lacks: {unknown}"


def test_every_variable_the_pages_name_exists() -> None:
    from loraplex.platform.settings import Settings

    hook = generated()
    known = {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields}
    known |= set(hook.described_sections().get(hook.OUTSIDE_SETTINGS, {}))
    known |= {"LORAPLEX_KEY", "LORAPLEX_API_KEY", "LORAPLEX_BASE_URL"}   # the shell's and the CLI's, not the server's
    for page in doc_pages():
        named_there = set(re.findall(r"LORAPLEX_[A-Z0-9_]*[A-Z0-9]", page.read_text()))
        assert named_there <= known, f"{page.relative_to(REPO_ROOT)} names no such setting: {sorted(named_there - known)}"


def test_defaults_written_in_page_tables_are_the_settings() -> None:
    """A hand-written table with a `default` column gives each setting's real default."""
    from loraplex.platform.settings import Settings

    units = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
    checked = 0
    for page in doc_pages():
        columns: list[str] = []
        for line in page.read_text().splitlines():
            if not line.startswith("|"):
                columns = []
                continue
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not columns:
                columns = cells
                continue
            found = re.fullmatch(r"`LORAPLEX_([A-Z0-9_]+)`", cells[0])
            if "default" not in columns or not found or found.group(1).lower() not in Settings.model_fields:
                continue
            default = Settings.model_fields[found.group(1).lower()].default
            written = cells[columns.index("default")].strip("`")
            size = re.fullmatch(r"(\d+) (KiB|MiB|GiB)", written)
            value = int(size.group(1)) * units[size.group(2)] if size else written
            assert str(value) == f"{default:g}" if isinstance(default, float) else str(value) == str(default), (
                f"{page.relative_to(REPO_ROOT)}: {cells[0]} default {written}, Settings has {default!r}")
            checked += 1
    assert checked >= 5


def test_every_route_is_documented() -> None:
    from loraplex.platform.app import create_app

    served = {f"{method.upper()} {path}" for path, operations in create_app().openapi()["paths"].items()
              for method in operations}
    table = (REPO_ROOT / "docs" / "api.md").read_text().split("## Routes", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `((?:GET|POST|PUT|PATCH|DELETE) /[^`]*)` \|", table, re.M))
    assert not served - documented, f"routes docs/api.md does not list: {sorted(served - documented)}"
    assert not documented - served, f"docs/api.md lists routes the app does not serve: {sorted(documented - served)}"


def test_code_and_tests_cite_no_issue_numbers_or_internal_tools() -> None:
    pattern = re.compile(r"issue ?#?[0-9]|device tool", re.IGNORECASE)
    offenders = []
    for folder in ("platform", "engine", "adapters", "grammar", "sessions", "billing", "benchmarks", "tests",
                   "migrations", "docs"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line) and path != Path(__file__):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}")
    for path in (REPO_ROOT / "pyproject.toml", REPO_ROOT / "Makefile", REPO_ROOT / "mkdocs.yml"):
        if pattern.search(path.read_text()):
            offenders.append(path.name)
    assert not offenders, f"issue numbers or internal tool names cited in code: {offenders}"
