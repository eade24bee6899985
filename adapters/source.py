"""The engine's `AdapterSource`: a ready adapter's weights, read from the blob store by id."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from loraplex.adapters.base_model import BaseModelSpec
from loraplex.adapters.models import AdapterStatus
from loraplex.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME, read_peft_adapter
from loraplex.adapters.registry import AdapterRegistry
from loraplex.adapters.store import BlobStore, link_adapter_files
from loraplex.engine.interfaces import AdapterWeights


def _require_files(folder: Path, adapter_id: str) -> None:
    """A missing file here is storage trouble (a blob gone, a folder moved), not a bad adapter: the engine
    treats FileNotFoundError as transient and retries, where a rejected adapter would stay failed."""
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (folder / name).exists():  # follows symlinks: a dangling one to a lost blob counts
            raise FileNotFoundError(f"{name} of adapter {adapter_id} is missing from storage")


class StoredAdapterSource:
    def __init__(self, registry: AdapterRegistry, store: BlobStore, spec: BaseModelSpec, dtype: torch.dtype) -> None:
        self.registry = registry
        self.store = store
        self.spec = spec
        self.dtype = dtype

    def load(self, adapter_id: str) -> AdapterWeights:
        info = self.registry.find(adapter_id)
        if info is None or info.status != AdapterStatus.READY:
            raise KeyError(adapter_id)
        with tempfile.TemporaryDirectory(prefix="lpx-load-") as tmp:
            folder = Path(tmp)
            link_adapter_files(self.store, folder, config_sha256=info.config_sha256, weights_sha256=info.sha256)
            _require_files(folder, adapter_id)
            return read_peft_adapter(folder, adapter_id, self.spec, dtype=self.dtype)


class FolderAdapterSource:
    """Adapters straight from PEFT folders on disk (tests, benchmarks, a fixed deployment)."""

    def __init__(self, folders: dict[str, Path], spec: BaseModelSpec, dtype: torch.dtype) -> None:
        self.folders = dict(folders)
        self.spec = spec
        self.dtype = dtype

    def load(self, adapter_id: str) -> AdapterWeights:
        folder = self.folders[adapter_id]
        _require_files(folder, adapter_id)
        return read_peft_adapter(folder, adapter_id, self.spec, dtype=self.dtype)

    def locate(self, adapter_id: str) -> str | None:
        """Where the files are: a failure tied to another place is retried at once (the engine asks)."""
        folder = self.folders.get(adapter_id)
        return None if folder is None else str(folder)
