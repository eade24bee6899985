"""`system_fingerprint`: which build answered, so a client can tell when outputs may change.

OpenAI documents it as the backend configuration a response came from. Ours
is a short hash of what decides the tokens: the package version, the served
model's name, the identity of its weight files and the adapter, if any. The
weights' identity is their names, sizes and modification times: free to
compute at any model size, and changed by any replacement of the files.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from loraplex.platform.settings import Settings

_WEIGHT_SUFFIXES = frozenset({".safetensors", ".gguf", ".bin", ".pt", ".json"})


@lru_cache(maxsize=1)
def package_version() -> str:
    try:
        return metadata.version("loraplex")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@lru_cache(maxsize=16)
def weights_identity(model_path: Path | None, models_dir: Path) -> str:
    """Computed once per served path: this process keeps serving the weights it loaded."""
    if model_path is None:
        from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME

        model_path = models_dir / DEFAULT_MODEL_NAME
    files: list[Path] = []
    if model_path.is_file():
        files = [model_path]
    elif model_path.is_dir():
        files = sorted(p for p in model_path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    parts = []
    for path in files:
        stat = path.stat()
        parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts) or str(model_path)


@lru_cache(maxsize=1024)
def _fingerprint(version: str, model: str, weights: str, adapter_id: str) -> str:
    digest = hashlib.sha256("\n".join((version, model, weights, adapter_id)).encode()).hexdigest()
    return "fp_" + digest[:12]


def system_fingerprint(settings: Settings, base_model_name: str, adapter_id: str | None) -> str:
    weights = weights_identity(settings.model_path, settings.models_dir)
    return _fingerprint(package_version(), base_model_name, weights, adapter_id or "")
