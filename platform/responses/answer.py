"""Engine outputs as a Responses answer: one response object, or the typed event stream that builds it.

Both paths feed the same OutputAssembler. The response is stored (and the
parent's pin let go) before the final `response.completed` event or the body
goes out, so a client can chain the next request the moment it has this one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from loraplex.engine.errors import DomainError
from loraplex.engine.protocol import FinishReason, RequestOutput
from loraplex.platform.affinity import chain_key
from loraplex.platform.api.generation import Generation
from loraplex.platform.api.keepalive import PrimedOutputs
from loraplex.platform.api.stream_tail import ChoiceFailed
from loraplex.platform.errors import ApiError, status_for
from loraplex.platform.responses.chain import ResponseChains
from loraplex.platform.responses.output import Event, OutputAssembler
from loraplex.platform.responses.turn import ResponseTurn, responses_usage
from loraplex.sessions.responses import StoredResponse


class _Answer:
    """One response's parser, assembler and final finish reason."""

    def __init__(self, gen: Generation) -> None:
        self.parser = gen.prepared.parser_factory()
        self.assembler = OutputAssembler()
        self.finish_reason: str | None = None

    def feed(self, output: RequestOutput) -> list[Event]:
        if output.error:
            raise ChoiceFailed(f"generation failed: {output.error}")
        events: list[Event] = []
        for delta in output.choices:
            if delta.text:
                events += self.assembler.feed(self.parser.feed(delta.text))
            if delta.finish_reason is not None:
                rest, self.finish_reason = self.parser.finish(delta.finish_reason)
                events += self.assembler.feed(rest)
                events += self.assembler.finish()
        return events

    def public(self, turn: ResponseTurn, gen: Generation) -> dict[str, Any]:
        usage = responses_usage(gen.usage())
        if self.finish_reason == FinishReason.LENGTH:
            return turn.public(status="incomplete", output=self.assembler.items, usage=usage,
                               incomplete_reason="max_output_tokens")
        return turn.public(status="completed", output=self.assembler.items, usage=usage)


async def _store(turn: ResponseTurn, chains: ResponseChains, gen: Generation, body: dict[str, Any]) -> None:
    if not turn.body.store:
        return
    record = StoredResponse(
        id=turn.response_id, tenant_id=gen.prepared.tenant_id, model=turn.body.model, body=body,
        input_items=turn.input_items, conversation=turn.conversation_after(body["output"]),
        previous_response_id=turn.body.previous_response_id, pin_key=gen.prepared.session_id,
        created_at=float(turn.created_at), session_key=chain_key(turn.parent, turn.response_id),
        replica_id=gen.services.settings.replica_id,
    )
    await chains.save(record, parent=turn.parent)
    turn.stored = True


def _release_unstored(turn: ResponseTurn, chains: ResponseChains, gen: Generation) -> None:
    """A response that was to be stored but was not (failed, refused, the client left) lets its KV go."""
    if gen.prepared.session_id and not turn.stored:
        chains.release_unstored(gen.prepared.session_id)


async def collect_response(gen: Generation, *, turn: ResponseTurn, chains: ResponseChains) -> dict[str, Any]:
    try:
        answer = _Answer(gen)
        async for _, output in gen.outputs(whole=True):
            answer.feed(output)
        body = answer.public(turn, gen)
        await _store(turn, chains, gen, body)
        return body
    finally:
        _release_unstored(turn, chains, gen)


def _event(event: Event, number: int) -> bytes:
    event["sequence_number"] = number
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def stream_response(gen: Generation, outputs: PrimedOutputs[tuple[int, RequestOutput]], *,
                          turn: ResponseTurn, chains: ResponseChains) -> AsyncIterator[bytes]:
    """created, in_progress, the items' events, then completed/incomplete; an `error` event on failure.

    Metering, pinning and storing all happen before the final event, whatever the client does next.
    """
    number = 0

    def emit(event: Event) -> bytes:
        nonlocal number
        number += 1
        return _event(event, number - 1)

    error: BaseException | None = None
    answer = _Answer(gen)
    started = turn.public(status="in_progress", output=[], usage=None)
    try:
        yield emit({"type": "response.created", "response": started})
        yield emit({"type": "response.in_progress", "response": started})
        async for comment in outputs.keepalives():
            yield comment
        async for _, output in outputs:
            for event in answer.feed(output):
                yield emit(event)
        await gen.close()
        body = answer.public(turn, gen)
        await _store(turn, chains, gen, body)
        final = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield emit({"type": final, "response": body})
    except (ApiError, DomainError) as exc:
        error = exc
        yield emit({"type": "error", "code": exc.code or "server_error", "message": exc.message,
                    "param": exc.param, "status": status_for(exc)})
        failed = turn.public(status="failed", output=answer.assembler.items, usage=responses_usage(gen.usage()),
                             error={"code": "server_error", "message": exc.message})
        yield emit({"type": "response.failed", "response": failed})
    except BaseException as exc:
        error = exc
        raise
    finally:
        await outputs.aclose()
        await gen.close(error)
        _release_unstored(turn, chains, gen)
