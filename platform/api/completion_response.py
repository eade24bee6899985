"""Engine outputs shaped as OpenAI legacy completions (`text_completion`), whole or as SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from loraplex.engine.protocol import RequestOutput
from loraplex.platform.api.chat_response import fingerprint_of
from loraplex.platform.api.generation import Generation
from loraplex.platform.api.keepalive import PrimedOutputs
from loraplex.platform.api.logprobs import LegacyLogprobs, TokenTexts
from loraplex.platform.api.sse import ChunkEncoder, sse
from loraplex.platform.api.stream_tail import ChoiceFailed, finish_stream


def prompt_texts(gen: Generation, tokenizer: Any) -> list[str]:
    """The prompts as text, for `echo` (token-id prompts are decoded)."""
    prompt = gen.prepared.body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in gen.prepared.prompts]


class _Choice:
    def __init__(self, texts: TokenTexts, echo_text: str) -> None:
        self.text: list[str] = [echo_text] if echo_text else []
        self.logprobs = LegacyLogprobs(texts)
        self.finish_reason: str | None = None


class _PromptParts:
    """Each prompt's part of the legacy logprobs (echo), built once and shared by the prompt's n choices: built per
    choice, a long prompt's entries were made n times over on the event loop."""

    def __init__(self, gen: Generation, texts: TokenTexts) -> None:
        self._prompts = gen.prepared.prompts
        self._texts = texts
        self._parts: dict[int, LegacyLogprobs] = {}

    def add_to(self, logprobs: LegacyLogprobs, prompt_index: int, output: RequestOutput) -> None:
        if output.prompt_logprobs is None or len(logprobs):
            return
        part = self._parts.get(prompt_index)
        if part is None:
            part = self._parts[prompt_index] = LegacyLogprobs(self._texts)
            part.add_prompt(self._prompts[prompt_index], output.prompt_logprobs)
        logprobs.extend(part)


async def collect_completion(gen: Generation, *, texts: TokenTexts, tokenizer: Any) -> dict[str, Any]:
    prepared = gen.prepared
    n = prepared.sampling.n
    echo = prepared.body.echo
    echoes = prompt_texts(gen, tokenizer) if echo else [""] * len(prepared.prompts)
    choices = [_Choice(texts, echoes[i // n]) for i in range(len(gen.choices))]
    want_logprobs = prepared.body.logprobs is not None
    echo_only = prepared.echo_only
    prompt_parts = _PromptParts(gen, texts)
    async for prompt_index, output in gen.outputs(whole=True):
        if output.error:
            raise ChoiceFailed(f"generation failed: {output.error}")
        for delta in output.choices:
            choice = choices[prompt_index * n + delta.index]
            if want_logprobs and echo:
                prompt_parts.add_to(choice.logprobs, prompt_index, output)
            if echo_only:  # the prompt alone: the token sampled after it is not part of the answer
                choice.finish_reason = choice.finish_reason or ("length" if delta.finish_reason else None)
                continue
            choice.text.append(delta.text)
            if want_logprobs and delta.logprobs:
                choice.logprobs.add(delta.logprobs)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
    return {
        "id": "cmpl-" + prepared.request_id.removeprefix("req_"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": prepared.model.id,
        "system_fingerprint": fingerprint_of(gen),
        "choices": [
            {
                "index": i,
                "text": "".join(c.text),
                "logprobs": c.logprobs.as_dict() if want_logprobs else None,
                "finish_reason": c.finish_reason or "stop",
            }
            for i, c in enumerate(choices)
        ],
        "usage": gen.usage(),
    }


def stream_completion(
    gen: Generation, outputs: PrimedOutputs[tuple[int, RequestOutput]], *, texts: TokenTexts, tokenizer: Any
) -> AsyncIterator[bytes]:
    prepared = gen.prepared
    n = prepared.sampling.n
    echo = prepared.body.echo
    echo_only = prepared.echo_only
    want_logprobs = prepared.body.logprobs is not None
    include_usage = bool(prepared.body.stream_options and prepared.body.stream_options.include_usage)
    echoes = prompt_texts(gen, tokenizer) if echo else []
    echoed = [False] * len(gen.choices)
    prompt_parts = _PromptParts(gen, texts)
    base: dict[str, Any] = {
        "id": "cmpl-" + prepared.request_id.removeprefix("req_"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": prepared.model.id,
        "system_fingerprint": fingerprint_of(gen),
    }
    if include_usage:
        base["usage"] = None

    encoder = ChunkEncoder(base)

    def chunk(index: int, text: str, logprobs: Any = None, finish_reason: str | None = None) -> bytes:
        return encoder.encode([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])

    async def chunks() -> AsyncIterator[bytes]:
        """One bytes object per engine output: all the events it makes go out in one write."""
        async for prompt_index, output in outputs:
            if output.error:
                raise ChoiceFailed(f"generation failed: {output.error}")
            events = []
            for delta in output.choices:
                index = prompt_index * n + delta.index
                text = "" if echo_only else delta.text  # echo_only: the token sampled after the prompt is not sent
                logprobs = LegacyLogprobs(texts) if want_logprobs else None
                if echo and not echoed[index]:
                    echoed[index] = True
                    text = echoes[prompt_index] + text
                    if logprobs is not None:
                        prompt_parts.add_to(logprobs, prompt_index, output)
                if logprobs is not None and delta.logprobs and not echo_only:
                    logprobs.add(delta.logprobs)
                if logprobs is not None and len(logprobs):
                    events.append(chunk(index, text, logprobs.as_dict()))
                elif text:
                    events.append(encoder.text(index, text))
                if delta.finish_reason is not None:
                    events.append(chunk(index, "", finish_reason="length" if echo_only else delta.finish_reason))
            if events:
                yield events[0] if len(events) == 1 else b"".join(events)

    def usage_chunk() -> bytes:
        return sse({**base, "choices": [], "usage": gen.usage()})

    return finish_stream(gen, chunks(), usage_chunk=usage_chunk if include_usage else None,
                         outputs=outputs)
