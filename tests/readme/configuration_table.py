"""README's Configuration table, read as data: which `LORAPLEX_*` variables it documents, and their defaults."""

from __future__ import annotations

import re
from pathlib import Path

SECTION = "## Configuration"
VARIABLE = re.compile(r"`(LORAPLEX_[A-Z0-9_]+|_[A-Z0-9_]+)`")


def table_rows(readme_text: str) -> list[list[str]]:
    """The cells of every row of the first table under the Configuration heading (header rows skipped)."""
    section = readme_text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == "variable":
            continue
        rows.append(cells)
    return rows


def names_in_cell(cell: str) -> list[str]:
    """`LORAPLEX_A_LOW` / `_MEDIUM` -> [LORAPLEX_A_LOW, LORAPLEX_A_MEDIUM]: a leading `_` shares the stem."""
    names: list[str] = []
    for token in VARIABLE.findall(cell):
        if token.startswith("_"):
            if not names:
                raise ValueError(f"{cell!r}: {token} has no full name before it")
            token = names[-1].rsplit("_", 1)[0] + token
        names.append(token)
    return names


def documented_variables(readme: Path) -> dict[str, str]:
    """variable -> the row's default cell, for every variable the table names."""
    documented: dict[str, str] = {}
    for cells in table_rows(readme.read_text()):
        names = names_in_cell(cells[0])
        defaults = [d.strip() for d in cells[1].split(" / ")] if len(cells) > 1 else []
        for i, name in enumerate(names):
            documented[name] = defaults[i] if len(defaults) == len(names) else cells[1]
    return documented
