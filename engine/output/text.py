"""The caller's side of a request's outputs: detokenization, stop strings, and merging queued deltas.

The engine sends token ids; `RequestText` (one per request, in the process
that reads the outputs: an API server, or the in-process client) turns them
into text and matches stop strings. A stop string ends its choice here: the
tokens after it are dropped (never delivered, never billed), and the caller
tells the engine to stop the request once every choice has ended. The engine
loop itself never detokenizes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loraplex.engine.output.detokenizer import IncrementalDetokenizer
from loraplex.engine.output.stop_strings import StopStringMatcher
from loraplex.engine.protocol import ChoiceDelta, EngineRequest, FinishReason, RequestOutput


@dataclass(slots=True)
class ChoiceText:
    detokenizer: IncrementalDetokenizer
    stop_strings: StopStringMatcher
    finished: bool = False
    num_kept_tokens: int = 0  # the choice's output tokens as delivered (those after a stop string cut off)


class RequestText:
    def __init__(self, request: EngineRequest, tokenizer: Any) -> None:
        sampling = request.sampling
        self.choices = [
            ChoiceText(IncrementalDetokenizer(tokenizer, request.prompt_token_ids, sampling.skip_special_tokens),
                       StopStringMatcher(sampling.stop, include_in_output=sampling.include_stop_str_in_output))
            for _ in range(sampling.n)
        ]
        self.finished = False          # every choice has ended (by the engine or by a stop string here)
        self.stopped_early = False     # ended here while the engine still runs it: stop it there

    def kept_token_counts(self) -> list[int]:
        """Output tokens each choice delivered: the engine counts what it generated past them as discarded."""
        return [choice.num_kept_tokens for choice in self.choices]

    def process(self, output: RequestOutput) -> RequestOutput | None:
        """`output` with its text filled in and stop strings applied (in place); None if nothing is left."""
        if self.finished:
            return None
        deltas = []
        for delta in output.choices:
            choice = self.choices[delta.index]
            if not choice.finished:
                _fill(choice, delta)
                deltas.append(delta)
        output.choices = deltas
        self.finished = all(c.finished for c in self.choices)
        if self.finished and not output.finished:
            self.stopped_early = True
            output.finished = True
        elif output.finished:
            self.finished = True
        if not deltas and not output.finished:
            return None
        return output


def _fill(choice: ChoiceText, delta: ChoiceDelta) -> None:
    detokenizer, stop_strings = choice.detokenizer, choice.stop_strings
    ids = delta.token_ids
    last = len(ids) - 1
    parts = []
    for k, token in enumerate(ids):
        if k == last and delta.finish_reason is not None:
            if delta.hide_last_token:
                break
            if isinstance(delta.stop_reason, int):  # a stop token id kept in the output: not matched on
                parts.append(stop_strings.flush() + detokenizer.add(token))
                break
        parts.append(stop_strings.feed(detokenizer.add(token)))
        if stop_strings.matched is not None:
            dropped = last - k
            if dropped:
                del ids[k + 1:]
                if delta.logprobs:
                    del delta.logprobs[k + 1:]
                delta.num_output_tokens -= dropped
            delta.finish_reason, delta.stop_reason, delta.hide_last_token = FinishReason.STOP, stop_strings.matched, False
            break
    choice.num_kept_tokens = delta.num_output_tokens
    if delta.finish_reason is not None:
        parts.append(stop_strings.flush())
        choice.finished = True
    delta.text = "".join(parts)


def merge(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one (what the caller had not read yet: one SSE chunk, not many)."""
    merged = outputs[0]
    by_index = {delta.index: delta for delta in merged.choices}
    # Each choice's pieces are gathered and joined once: adding them one output at a time copied the growing
    # text, ids and logprobs again for every output (quadratic: 0.4 s of the event loop for n=16 x 2,000 steps
    # with top_logprobs).
    texts: dict[int, list[str]] = {}
    for output in outputs[1:]:
        for delta in output.choices:
            into = by_index.get(delta.index)
            if into is None:
                by_index[delta.index] = delta
                merged.choices.append(delta)
                continue
            if delta.index not in texts:  # first piece added: lists of our own, safe to extend in place
                texts[delta.index] = [into.text]
                into.token_ids = list(into.token_ids)
                into.logprobs = None if into.logprobs is None else list(into.logprobs)
            texts[delta.index].append(delta.text)
            into.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                if into.logprobs is None:
                    into.logprobs = []
                into.logprobs.extend(delta.logprobs)
            into.finish_reason, into.stop_reason = delta.finish_reason, delta.stop_reason
            into.hide_last_token = delta.hide_last_token
            into.num_output_tokens, into.num_reasoning_tokens = delta.num_output_tokens, delta.num_reasoning_tokens
        merged.finished = output.finished
        merged.num_prompt_tokens, merged.num_cached_tokens = output.num_prompt_tokens, output.num_cached_tokens
        merged.prompt_logprobs = merged.prompt_logprobs if merged.prompt_logprobs is not None else output.prompt_logprobs
        merged.error = output.error or merged.error
    for index, pieces in texts.items():
        by_index[index].text = "".join(pieces)
    return merged


class OutputStream:
    """One request's outputs as its caller reads them: queued by the engine side as they come, made into text
    here, and whatever queued up while the caller was busy handed over merged, as one output."""

    def __init__(self, request: EngineRequest, tokenizer: Any, *, whole: bool = False,
                 on_stop: Callable[[], None] | None = None) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.text = RequestText(request, tokenizer)
        self._error: BaseException | None = None
        # Whole: the caller reads only the finished output (a non-streaming response), so the steps' outputs
        # are held here and handed over, merged and made into text, once the request ends: no wake-up and no
        # detokenizer call per step. Not where stop strings must be matched as the text grows (to stop the
        # engine early).
        self.whole = whole and not request.sampling.stop
        self._held: list[RequestOutput] = []
        # With stop strings, each output is made into text as it is handed over, not when the caller reads it:
        # a caller blocked on a slow client would otherwise leave the engine decoding past the stop string (up
        # to max_tokens or the send timeout) on a slot another request could use. `on_stop` is called once, at
        # the hand-over that matched, so the engine stops the request then.
        self.eager = bool(request.sampling.stop)
        self._on_stop = on_stop
        self._read_final = False

    def deliver(self, output: RequestOutput) -> None:
        """The engine side's next output (on the caller's event loop)."""
        if self.eager:  # never whole: nothing is held
            processed = self.text.process(output)
            if processed is not None:
                self.queue.put_nowait(processed)
            if self.text.stopped_early and self._on_stop is not None:
                on_stop, self._on_stop = self._on_stop, None
                on_stop()
            return
        if self.whole and not output.finished:
            if not self._held:
                output.received_at = time.monotonic()
            self._held.append(output)
            return
        self._release()
        self.queue.put_nowait(output)

    def fail(self, error: BaseException) -> None:
        """The engine side's error, after whatever it had sent before it."""
        self._release()
        self.queue.put_nowait(error)

    def _release(self) -> None:
        if self._held:
            held, self._held = self._held, []
            for item in held:
                self.queue.put_nowait(item)

    @property
    def finished(self) -> bool:
        """The caller has read the final output (an eager stream's text may have ended before it was read)."""
        return self._read_final

    async def next(self) -> RequestOutput:
        """The next output to deliver; raises the engine side's error once the outputs before it are read."""
        while True:
            if self._error is not None:
                raise self._error
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            ready = [item for item in items if not isinstance(item, BaseException)]
            if self.whole and len(items) > 1 and len(ready) == len(items):
                items = [merge(ready)]  # one detokenizing pass over all the tokens
            outputs = []
            for item in items:
                if isinstance(item, BaseException):
                    self._error = item
                    break
                output = item if self.eager else self.text.process(item)  # eager: made into text already
                if output is not None:
                    outputs.append(output)
                    if output.finished:
                        break
            if outputs:
                self._read_final = outputs[-1].finished
                return outputs[0] if len(outputs) == 1 else merge(outputs)
