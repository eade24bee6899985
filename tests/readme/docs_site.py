"""The docs site's generated parts, loaded the way MkDocs loads them: docs/hooks/generated.py by path."""

from __future__ import annotations

import importlib.util
from functools import cache
from types import ModuleType

from readme_examples import REPO_ROOT

HOOK = REPO_ROOT / "docs" / "hooks" / "generated.py"


@cache
def generated() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generated", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
