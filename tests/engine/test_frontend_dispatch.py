"""The engine front end hands a step's outputs over first tokens first.

Each stream's reader wakes in the order its outputs are handed over and writes its chunk: a request's first
token handed over after the tokens of another tenant's many streams on the same API server waited for all of
their writes. The core is replaced here by a transport the test feeds, so the order of one step's message is
exactly what the test says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from enginecore_helpers import tiny_random_config
from loraplex.engine.core.frontend import EngineFrontend
from loraplex.engine.core.messages import Outputs
from loraplex.engine.cuda.random_weights import SyntheticTokenizer
from loraplex.engine.protocol import ChoiceDelta, EngineRequest, RequestOutput, SamplingParams
from waiting import async_wait_until

VOCAB = 1000


class FedTransport:
    """A client transport whose core is the test: what the front end sends is kept, what the test feeds is
    received as the core's messages."""

    pid = 0

    def __init__(self) -> None:
        self.initial_stats: dict[str, Any] = {}
        self.sent: list[Any] = []
        self.receive: Callable[[Any], None] | None = None

    def start(self, receive: Callable[[Any], None], on_dead: Callable[[str], None]) -> None:
        self.receive = receive

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def add_message(self, request: EngineRequest) -> Any:
        return request

    def validate(self, request: EngineRequest) -> None:
        pass

    def dead_reason(self) -> str | None:
        return None

    def close(self) -> None:
        pass


def token(request_id: str, token_id: int, count: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [ChoiceDelta(0, token_ids=[token_id], num_output_tokens=count,
                                                  finish_reason="length" if finished else None)],
                         finished, num_prompt_tokens=3, num_cached_tokens=0)


async def test_a_first_token_is_handed_over_before_other_streams_next_tokens() -> None:
    transport = FedTransport()
    frontend = EngineFrontend(transport, tokenizer=SyntheticTokenizer(VOCAB),  # type: ignore[arg-type]
                              model_config=tiny_random_config(vocab_size=VOCAB), max_model_len=128)
    woke: list[tuple[str, int]] = []

    async def read(request_id: str) -> None:
        request = EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        async for output in frontend.generate(request):
            woke.append((request_id, output.choices[0].num_output_tokens))

    floods = [f"flood-{i}" for i in range(4)]
    readers = [asyncio.create_task(read(rid)) for rid in [*floods, "victim"]]
    await async_wait_until(lambda: len(transport.sent) == len(readers), what="every request sent to the core")
    assert transport.receive is not None
    transport.receive(Outputs([token(rid, 7, 1) for rid in floods], []))
    await async_wait_until(lambda: len(woke) == len(floods), what="the floods' first tokens read")
    # one step: the floods' second (last) tokens first in the core's order, the victim's first token last
    transport.receive(Outputs([*(token(rid, 8, 2, finished=True) for rid in floods), token("victim", 9, 1)], []))
    await async_wait_until(lambda: len(woke) == 2 * len(floods) + 1, what="the second step read")
    assert woke[len(floods)] == ("victim", 1)  # woke before any flood stream of the same step
    assert sorted(woke[len(floods) + 1:]) == [(rid, 2) for rid in floods]
    transport.receive(Outputs([token("victim", 10, 2, finished=True)], []))
    await asyncio.wait_for(asyncio.gather(*readers), timeout=30)
    assert woke[-1] == ("victim", 2)
