"""Freezing a server process's start-up heap: full collections stop scanning it, and garbage made later is
still collected. Run in a child process: freezing the test process would keep later tests' garbage forever."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import gc, json, time, weakref
import torch, transformers  # what a server process holds after start-up
from loraplex.platform.app import create_app
from loraplex.platform.startup_heap import freeze_startup_heap

def full_pass_ms():
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        gc.collect()
        best = min(best, (time.perf_counter() - started) * 1e3)
    return best

before = full_pass_ms()
frozen = freeze_startup_heap("test")
after = full_pass_ms()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made while serving: only the cyclic collector frees it
watch = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({"before_ms": before, "after_ms": after, "frozen": frozen, "cycle_freed": watch() is None}))
"""


def test_a_frozen_startup_heap_leaves_full_passes_short_and_later_cycles_collected() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["frozen"] > 100_000, result
    assert result["after_ms"] < result["before_ms"] / 10, result
    assert result["cycle_freed"], result
