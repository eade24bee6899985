"""The fenced code blocks of README.md and of the docs site (docs/*.md) as named, runnable examples.

Every fenced block is preceded by a marker line

    <!-- example: NAME -->

and some test in tests/readme/ (or tests/browser/) carries `@readme_example("NAME")` and runs or
checks that block's text. Names are unique across the README and every docs page.
`test_readme_coverage.py` fails when a block has no marker, when a marker has no test, or when a test
names a block that no page has any more. To add an example: write the block with a fresh marker above
it, then a test decorated with that name that runs it (`run_python` / `BashSession` below) and checks
what it printed or returned.

Placeholders such as `lpx_...` (a key), `key_...`, `adp_...` or `sess_...` (ids) and the address
`127.0.0.1:8000` are replaced by real values before a block runs; nothing else of its text is changed.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
MARKER = re.compile(r"^<!--\s*example:\s*([a-z0-9][a-z0-9-]*)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")
DECORATOR_NAME = "readme_example"


@dataclass(frozen=True, slots=True)
class Example:
    name: str | None     # None: the block has no marker (a defect the coverage test reports)
    lang: str
    text: str
    line: int            # 1-based line of the opening fence
    source: str = "README.md"   # the page it is on, relative to the repository


def doc_pages() -> list[Path]:
    """README.md and every page of the docs site, in a stable order."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts)]


def parse_examples(markdown: str, source: str = "README.md") -> list[Example]:
    """Every fenced block, with the marker found on the nearest non-blank line above it."""
    lines = markdown.splitlines()
    examples: list[Example] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"{source} line {i + 1}: a code fence that is never closed")
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(above.strip())
        examples.append(Example(name=marker.group(1) if marker else None, lang=opening.group(1),
                                text="\n".join(lines[i + 1:end]) + "\n", line=i + 1, source=source))
        i = end + 1
    return examples


def all_examples() -> list[Example]:
    """Every fenced block of the README and the docs pages, named or not."""
    return [e for page in doc_pages() for e in parse_examples(page.read_text(), str(page.relative_to(REPO_ROOT)))]


def doc_examples() -> dict[str, Example]:
    return {e.name: e for e in all_examples() if e.name}


def named(name: str) -> Example:
    """The block marked `<!-- example: name -->` in the README or a docs page; the test fails if none is."""
    examples = doc_examples()
    if name not in examples:
        pytest.fail(f"no README or docs block is marked <!-- example: {name} -->")
    return examples[name]


def readme_example(name: str) -> pytest.MarkDecorator:
    """Marks a test as the one that runs the README or docs block `name` (its `example` fixture)."""
    return pytest.mark.readme_example(name)


def covered_names(test_files: list[Path]) -> dict[str, list[str]]:
    """name -> the tests whose `@readme_example("name")` decorator names it, read from the source."""
    covered: dict[str, list[str]] = {}
    for path in test_files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.name.startswith("test"):
                continue
            for decorator in node.decorator_list:
                if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Name)
                        and decorator.func.id == DECORATOR_NAME and decorator.args
                        and isinstance(decorator.args[0], ast.Constant)):
                    covered.setdefault(decorator.args[0].value, []).append(f"{path.name}::{node.name}")
    return covered


def substitute(text: str, values: dict[str, str]) -> str:
    """Placeholders replaced, longest first (so `lpx_<admin key>` wins over `lpx_`)."""
    for placeholder in sorted(values, key=len, reverse=True):
        text = text.replace(placeholder, values[placeholder])
    return text


# ---- python blocks --------------------------------------------------------------------------------

@dataclass
class PythonRun:
    """A python block run statement by statement; the value of every bare expression is kept."""

    namespace: dict[str, Any]
    values: list[tuple[str, Any]] = field(default_factory=list)
    printed: list[str] = field(default_factory=list)

    def value_of(self, fragment: str) -> Any:
        """The value of the one top-level expression whose source contains `fragment`."""
        found = [value for source, value in self.values if fragment in source]
        if len(found) != 1:
            raise AssertionError(f"{len(found)} expressions contain {fragment!r}: "
                                 f"{[source for source, _ in self.values]}")
        return found[0]


def run_python(example: Example, values: dict[str, str], namespace: dict[str, Any] | None = None,
               cwd: Path | None = None) -> PythonRun:
    """Execute the block's text (placeholders replaced) like a notebook: each bare expression's value kept."""
    source = substitute(example.text, values)
    tree = ast.parse(source)
    run = PythonRun(namespace=namespace if namespace is not None else {})
    run.namespace["print"] = _recording_print(run.printed)
    with _working_directory(cwd):
        for statement in tree.body:
            segment = ast.get_source_segment(source, statement) or ""
            if isinstance(statement, ast.Expr):
                code = compile(ast.Expression(statement.value), f"{example.source}:{example.name}", "eval")
                run.values.append((segment, eval(code, run.namespace)))
            else:
                module = ast.Module(body=[statement], type_ignores=[])
                exec(compile(module, f"{example.source}:{example.name}", "exec"), run.namespace)
    del run.namespace["print"]
    return run


def _recording_print(printed: list[str]) -> Any:
    def record(*args: Any, sep: str = " ", end: str = "\n", **_: Any) -> None:
        printed.append(sep.join(str(a) for a in args) + end)

    return record


class _working_directory:
    def __init__(self, path: Path | None) -> None:
        self.path, self.previous = path, ""

    def __enter__(self) -> None:
        self.previous = os.getcwd()
        if self.path is not None:
            os.chdir(self.path)

    def __exit__(self, *exc: object) -> None:
        os.chdir(self.previous)


# ---- bash blocks ----------------------------------------------------------------------------------

def bash_commands(example: Example) -> list[str]:
    """The block's commands: continuation lines joined, blank lines dropped (comments stay for bash)."""
    commands: list[str] = []
    pending = ""
    for line in example.text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


@dataclass
class BashSession:
    """Runs a block's commands one by one in `cwd`; `export` lines carry over to the later commands."""

    cwd: Path
    env: dict[str, str]
    values: dict[str, str]
    exports: list[str] = field(default_factory=list)

    def run(self, command: str, *, check: bool = True, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        command = substitute(command, self.values)
        if command.startswith("export "):
            self.exports.append(command)
        script = "\n".join([*self.exports, command]) if not command.startswith("export ") else command
        result = subprocess.run(["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True,
                                text=True, timeout=timeout_s)
        if check and result.returncode != 0:
            raise AssertionError(f"`{command}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def start(self, command: str, log_path: Path) -> subprocess.Popen[bytes]:
        """A long-running command (a server, a worker) in the background, in a session of its own."""
        command = substitute(command, self.values)
        with log_path.open("wb") as log:
            return subprocess.Popen(["bash", "-c", "\n".join([*self.exports, command])], cwd=self.cwd,
                                    env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def run_all(self, example: Example) -> Iterator[tuple[str, subprocess.CompletedProcess[str]]]:
        for command in bash_commands(example):
            yield command, self.run(command)
