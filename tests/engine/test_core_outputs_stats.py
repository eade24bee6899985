"""The engine core's counters ride with a step's outputs when a request ends in them (a client that sees it finish
sees it counted), and otherwise at most every 50 ms: building and encoding them each step cost a busy loop."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from enginecore_helpers import greedy, tiny_random_config
from loraplex.engine.config import EngineConfig
from loraplex.engine.core.engine_core import _STATS_WITH_OUTPUTS_S, EngineCore
from loraplex.engine.core.local_transport import LocalCoreTransport
from loraplex.engine.core.messages import LocalAdd, Outputs, Shutdown
from loraplex.engine.cuda.random_weights import SyntheticTokenizer
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest
from waiting import wait_until


def test_outputs_carry_the_counters_when_a_request_ends_and_at_most_every_interval_otherwise() -> None:
    config = tiny_random_config(vocab_size=512)
    engine = LLMEngine.from_random(config, EngineConfig(num_blocks=64, max_model_len=256), SyntheticTokenizer(512),
                                   detokenize=False)
    transport = LocalCoreTransport()
    received: list[tuple[float, Any]] = []
    client = transport.connect(lambda message: received.append((time.monotonic(), message)))
    core = EngineCore(engine, transport, client_timeout_s=None)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    try:
        transport.put(client, LocalAdd(EngineRequest("long", [1, 2, 3, 4], greedy(60, ignore_eos=True))))
        transport.put(client, LocalAdd(EngineRequest("short", [5, 6, 7], greedy(5, ignore_eos=True))))
        wait_until(lambda: any(isinstance(m, Outputs) and any(o.request_id == "long" and o.finished for o in m.outputs)
                               for _, m in received), timeout_s=120, what="both requests finished")
    finally:
        transport.put(client, Shutdown())
        thread.join(30)
    outputs = [(at, m) for at, m in received if isinstance(m, Outputs)]
    assert len(outputs) >= 30  # one message a step
    for _, message in outputs:
        if any(o.finished for o in message.outputs):
            # The counters after that step: the finished request's tokens are in them
            assert message.stats is not None and message.stats["generation_tokens_total"] >= 5
    with_stats = [at for at, m in outputs if m.stats is not None]
    assert len(with_stats) < len(outputs)  # most steps send none
    unfinished = [at for at, m in outputs if m.stats is not None and not any(o.finished for o in m.outputs)]
    for earlier, later in itertools.pairwise(unfinished):
        assert later - earlier >= _STATS_WITH_OUTPUTS_S * 0.9
    final = next(m for _, m in outputs if any(o.request_id == "long" and o.finished for o in m.outputs))
    assert final.stats["generation_tokens_total"] == 65

