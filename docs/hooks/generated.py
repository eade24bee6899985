"""MkDocs hook: the pages' generated parts, rendered from the code and the results at build time.

A page asks for one with a marker line, replaced when the site is built:

    <!-- generated: settings -->     every field of `Settings`: variable, type and bounds, default, meaning
    <!-- generated: benchmarks -->   one table per benchmarks/results/*.json (benchmarks/results_table.py)

Nothing generated is stored in docs/, so a new setting or a new result shows up without a hand edit.
The docs tests import this file by path and check the same functions.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import io
import tokenize
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
DESCRIPTIONS = Path(__file__).with_name("settings.yml")
OUTSIDE_SETTINGS = "Outside Settings"
OTHER_SECTION = "Other settings"
ENV_PREFIX = "LORAPLEX_"


# ---- settings ---------------------------------------------------------------------------------------

def described_sections() -> dict[str, dict[str, Any]]:
    """settings.yml: section -> {field name: description}, in page order (plus the outside-Settings variables)."""
    return yaml.safe_load(DESCRIPTIONS.read_text())


def source_comments(settings_cls: type) -> dict[str, str]:
    """field -> its comment in the class source: the one on its line, else the comment lines right above it."""
    source = inspect.getsource(inspect.getmodule(settings_cls))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef) and node.name == settings_cls.__name__):
            continue
        group = ""   # a comment block above a run of fields (no blank line between) speaks for all of them
        previous_end = 0
        for statement in node.body:
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                group, previous_end = "", 0
                continue
            line = statement.lineno
            above: list[str] = []
            while line - 1 - len(above) in comments and lines[line - 2 - len(above)].lstrip().startswith("#"):
                above.insert(0, comments[line - 1 - len(above)])
            if above:
                group = " ".join(above)
            elif previous_end != line - 1:
                group = ""
            previous_end = statement.end_lineno or line
            own = comments.get(line) if not lines[line - 1].lstrip().startswith("#") else None
            if own and not above:
                found[statement.target.id] = own
            elif group:
                found[statement.target.id] = f"{group} ({own})" if own else group
    return found


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def default_text(field_info: Any) -> str:
    """The default as an operator would write it in the environment."""
    factory = field_info.default_factory
    if factory is not None:
        if factory in (list, dict, set, tuple):
            return "empty"
        return f"computed at start (`{factory.__module__.lstrip('_')}.{factory.__qualname__}()`)"
    value = field_info.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, Path) and not value.is_absolute():
        return f"`./{value}`"
    if isinstance(value, int) and value >= 1024**2 and value % 1024**2 == 0:
        size = f"{value // 1024**3} GiB" if value % 1024**3 == 0 else f"{value // 1024**2} MiB"
        return f"`{value}` ({size})"
    return f"`{value}`"


def accepts_text(field_info: Any) -> str:
    """The value's kind and bounds, e.g. `integer ≥ 0`."""
    annotation = str(field_info.annotation)
    kind = next((word for key, word in (("bool", "true/false"), ("int", "integer"), ("float", "number"),
                                         ("Path", "path"), ("list", "list"), ("str", "text"))
                 if key in annotation), "text")
    bounds = []
    for constraint in field_info.metadata:
        for attribute, symbol in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(constraint, attribute, None)
            if value is not None:
                bounds.append(f"{symbol} {value:g}" if isinstance(value, float) else f"{symbol} {value}")
    return " ".join([kind, ", ".join(bounds)]).strip()


def settings_rows(settings_cls: type | None = None) -> dict[str, list[dict[str, str]]]:
    """section -> rows {variable, accepts, default, description}: every Settings field exactly once."""
    if settings_cls is None:
        from loraplex.platform.settings import Settings as settings_cls
    fields = settings_cls.model_fields
    sections = described_sections()
    comments = source_comments(settings_cls)
    rows: dict[str, list[dict[str, str]]] = {}
    placed: set[str] = set()
    for section, described in sections.items():
        if section == OUTSIDE_SETTINGS:
            continue
        for name, description in described.items():
            if name not in fields:   # renamed or removed: the docs tests name it; the site still builds
                continue
            placed.add(name)
            rows.setdefault(section, []).append(row(name, fields[name], description))
    for name, info in fields.items():
        if name not in placed:
            rows.setdefault(OTHER_SECTION, []).append(row(name, info, info.description or comments.get(name, "")))
    for variable, entry in sections.get(OUTSIDE_SETTINGS, {}).items():
        rows.setdefault(OUTSIDE_SETTINGS, []).append({
            "variable": variable, "accepts": "text", "default": f"`{entry['default']}`",
            "description": f"{entry['description']} (read by `{entry['read_by']}`)"})
    return rows


def row(name: str, info: Any, description: str) -> dict[str, str]:
    return {"variable": env_name(name), "accepts": accepts_text(info), "default": default_text(info),
            "description": description}


def settings_markdown() -> str:
    out = []
    for section, rows in settings_rows().items():
        out += [f"## {section}", "", "| variable | accepts | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{r['variable']}` | {r['accepts']} | {r['default']} | {cell(r['description'])} |" for r in rows]
        out.append("")
    return "\n".join(out)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---- benchmarks -------------------------------------------------------------------------------------

def results_table() -> ModuleType:
    """benchmarks/results_table.py (benchmarks/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "benchmarks" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATORS = {"settings": settings_markdown, "benchmarks": lambda: results_table().markdown()}


def render(markdown: str) -> str:
    """Every `<!-- generated: NAME -->` line replaced by what NAME's generator renders."""
    out = []
    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("<!-- generated:") and stripped.endswith("-->"):
            name = stripped.removeprefix("<!-- generated:").removesuffix("-->").strip()
            if name not in GENERATORS:
                raise ValueError(f"unknown generated block {name!r}; known: {sorted(GENERATORS)}")
            out.append(GENERATORS[name]())
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, **_: Any) -> str:
    return render(markdown)
