"""Kernel tests run for real on a GPU and through Triton's interpreter on the CPU.

Triton decides between compiling and interpreting when a kernel is decorated, so the
interpreter must be switched on before any kernel module is imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run them on a machine with one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
