"""Keep the garbage collector off the objects a server process made while starting up.

Python's cyclic garbage collector now and then makes a full pass over every object it tracks. A server
process that has imported torch, transformers and the app tracks about half a million objects after start-up
(the model's modules, the tokenizer, every imported module's functions and classes), and one full pass over
them took 280 ms on a 2-core Xeon: a pause of the whole process, so every tenant's next token and every
waiting request's first token waited for it. Those objects live as long as the process, so scanning them never
frees anything. `gc.freeze()` moves them to a permanent generation the collector skips: later full passes
see only what the process made while serving. (vLLM freezes its engine core's start-up heap the same way.)

Called once, when a process is ready to serve: the engine core before its first step, an API server after its
app's start-up. Not in tests that build apps in one process: there, later tests' garbage would be frozen too.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Collect what start-up left behind, then freeze everything still alive. Returns how many objects froze."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of the garbage collector's full passes (%.0f ms)",
             process, frozen, (time.perf_counter() - started) * 1e3)
    return frozen
