"""Engine outputs shaped as OpenAI chat completions: one JSON body, or `chat.completion.chunk` SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from loraplex.engine.protocol import RequestOutput
from loraplex.platform.api.fingerprint import system_fingerprint
from loraplex.platform.api.generation import Generation
from loraplex.platform.api.keepalive import PrimedOutputs
from loraplex.platform.api.logprobs import TokenTexts, chat_logprobs
from loraplex.platform.api.sse import ChunkEncoder, sse
from loraplex.platform.api.stream_tail import ChoiceFailed, finish_stream
from loraplex.platform.extensions import MessageDelta, MessageParser


def fingerprint_of(gen: Generation) -> str:
    services = gen.services
    return system_fingerprint(services.settings, services.base_model_name, gen.prepared.model.adapter_id)


def _merge_tool_calls(calls: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Fold streaming tool-call deltas (by `index`) into whole calls."""
    for delta in deltas:
        index = delta.get("index", len(calls))
        while len(calls) <= index:
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[index]
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


class _ChoiceText:
    def __init__(self, parser: MessageParser) -> None:
        self.parser = parser
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []

    def add(self, delta: MessageDelta) -> None:
        if delta.content:
            self.content.append(delta.content)
        if delta.reasoning_content:
            self.reasoning.append(delta.reasoning_content)
        if delta.tool_calls:
            _merge_tool_calls(self.tool_calls, delta.tool_calls)


async def collect_chat(gen: Generation, *, texts: TokenTexts, created: int) -> dict[str, Any]:
    prepared = gen.prepared
    want_logprobs = prepared.sampling.logprobs is not None
    choices = [_ChoiceText(prepared.parser_factory()) for _ in gen.choices]
    finish: list[str] = ["stop"] * len(choices)
    async for _, output in gen.outputs(whole=True):
        if output.error:
            raise ChoiceFailed(f"generation failed: {output.error}")
        for delta in output.choices:
            choice = choices[delta.index]
            choice.add(choice.parser.feed(delta.text))
            if want_logprobs and delta.logprobs:
                choice.logprobs.extend(chat_logprobs(delta.logprobs, texts))
            if delta.finish_reason is not None:
                rest, finish[delta.index] = choice.parser.finish(delta.finish_reason)
                choice.add(rest)
    body_choices = []
    for index, choice in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.content) if not choice.tool_calls or choice.content else None}
        if choice.reasoning:
            message["reasoning_content"] = "".join(choice.reasoning)
        if choice.tool_calls:
            message["tool_calls"] = choice.tool_calls
        body_choices.append({
            "index": index,
            "message": message,
            "logprobs": {"content": choice.logprobs} if want_logprobs else None,
            "finish_reason": finish[index],
        })
    return {
        "id": "chatcmpl-" + prepared.request_id.removeprefix("req_"),
        "object": "chat.completion",
        "created": created,
        "model": prepared.model.id,
        "system_fingerprint": fingerprint_of(gen),
        "choices": body_choices,
        "usage": gen.usage(),
    }


def _delta_dict(delta: MessageDelta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.content:
        out["content"] = delta.content
    if delta.reasoning_content:
        out["reasoning_content"] = delta.reasoning_content
    if delta.tool_calls:
        out["tool_calls"] = delta.tool_calls
    return out


def stream_chat(
    gen: Generation, outputs: PrimedOutputs[tuple[int, RequestOutput]], *, texts: TokenTexts
) -> AsyncIterator[bytes]:
    """SSE body: role chunk per choice, content chunks, a finish chunk per choice, usage, [DONE].

    `outputs` is `gen.outputs()` primed (keepalive.prime_within), so engine errors at submission
    became real HTTP errors; the generation is closed here, whatever happens.
    """
    prepared = gen.prepared
    want_logprobs = prepared.sampling.logprobs is not None
    include_usage = bool(prepared.body.stream_options and prepared.body.stream_options.include_usage)
    base = {
        "id": "chatcmpl-" + prepared.request_id.removeprefix("req_"),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": prepared.model.id,
        "system_fingerprint": fingerprint_of(gen),
    }
    if include_usage:
        base["usage"] = None
    parsers = [prepared.parser_factory() for _ in gen.choices]

    encoder = ChunkEncoder(base)

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> bytes:
        return encoder.encode([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def delta_chunk(index: int, message: MessageDelta, logprobs: Any) -> bytes:
        if logprobs is None and not message.reasoning_content and not message.tool_calls:
            return encoder.content(index, message.content) if message.content else b""
        body = _delta_dict(message)
        return chunk(index, body, logprobs=logprobs) if body or logprobs else b""

    async def chunks() -> AsyncIterator[bytes]:
        """One bytes object per engine output: all the events it makes go out in one write."""
        first = b"".join(chunk(index, {"role": "assistant", "content": ""}) for index in range(len(gen.choices)))
        async for _, output in outputs:
            if output.error:
                if first:
                    yield first
                raise ChoiceFailed(f"generation failed: {output.error}")
            events = [first] if first else []
            first = b""
            for delta in output.choices:
                parser = parsers[delta.index]
                logprobs = {"content": chat_logprobs(delta.logprobs, texts)} if want_logprobs and delta.logprobs else None
                if delta.text or logprobs:
                    event = delta_chunk(delta.index, parser.feed(delta.text) if delta.text else MessageDelta(), logprobs)
                    if event:
                        events.append(event)
                if delta.finish_reason is not None:
                    rest, finish_reason = parser.finish(delta.finish_reason)
                    events.append(chunk(delta.index, _delta_dict(rest), finish_reason=finish_reason))
            if events:
                yield events[0] if len(events) == 1 else b"".join(events)

    def usage_chunk() -> bytes:
        return sse({**base, "choices": [], "usage": gen.usage()})

    return finish_stream(gen, chunks(), usage_chunk=usage_chunk if include_usage else None,
                         outputs=outputs)

