"""One API request's life in the engine: admission, outputs, abort, accounting, metering.

`Generation` owns everything that must happen exactly once per request:
the in-flight slot, the rate-limit charge, the abort of unfinished engine
requests (client gone, error), the metrics and the usage record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request
from loraplex.engine.errors import EngineDeadError, InvalidRequestError
from loraplex.engine.protocol import EngineRequest, FinishReason, RequestOutput
from loraplex.platform.deps import Principal
from loraplex.platform.extensions import PreparedRequest, RequestRecord, RequestStatus
from loraplex.platform.metrics import TokenTimer
from loraplex.platform.services import Services

log = logging.getLogger(__name__)
T = TypeVar("T")
# How long a closing generation waits for its cancelled readers: one engine round trip, normally milliseconds.
_SETTLE_TIMEOUT_S = 5.0


class ClientDisconnected(Exception):
    pass


@dataclass(slots=True)
class ChoiceCounts:
    num_output_tokens: int = 0
    num_reasoning_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class PromptCounts:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finished: bool = False
    num_outputs: int = 0          # outputs the engine sent for this prompt (0: it may have refused it)


class Generation:
    def __init__(self, services: Services, key: Principal, prepared: PreparedRequest) -> None:
        self.services = services
        self.key = key
        self.prepared = prepared
        self.started_at = time.time()
        self._timer = TokenTimer(services.metrics, time.monotonic())
        num_prompts = len(prepared.prompts)
        self.choices = [ChoiceCounts() for _ in range(num_prompts * prepared.sampling.n)]
        self.prompt_counts = [PromptCounts(num_prompt_tokens=len(p)) for p in prepared.prompts]
        self.engine_request_ids = [
            prepared.request_id if num_prompts == 1 else f"{prepared.request_id}-{i}" for i in range(num_prompts)
        ]
        self._started: set[int] = set()
        self._num_finished = 0
        self._engine_streams: dict[int, AsyncGenerator[RequestOutput, None]] = {}
        self._admitted = False
        self._closed = False
        self._aborted = False

    # -- admission --------------------------------------------------------------------------

    async def admit(self) -> None:
        """The checks that need the prompt's size (the in-flight slots and requests-per-minute were taken
        before preparation: api/admission.py). Refused: the slots are given back at once."""
        ticket = self.prepared.admission
        try:
            await ticket.charge_prompt(sum(len(p) for p in self.prepared.prompts))
            # Last: the budget check reserves the request's maximum cost, which nothing after it could refuse
            # and leave held until the reservation lapses.
            for check in self.services.extensions.admission_checks:
                await check(self.prepared)
        except BaseException:
            ticket.release()
            raise
        self._admitted = True

    # -- outputs ----------------------------------------------------------------------------

    def _engine_request(self, index: int) -> EngineRequest:
        self._started.add(index)
        prepared = self.prepared
        return EngineRequest(
            request_id=self.engine_request_ids[index],
            prompt_token_ids=prepared.prompts[index],
            sampling=prepared.sampling,
            tenant_id=prepared.tenant_id,
            adapter_id=prepared.model.adapter_id,
            cache_salt=prepared.cache_salt,
            grammar=prepared.grammar,
            reasoning=prepared.reasoning,
            session_id=prepared.session_id,
            priority=prepared.priority,
            background=prepared.background,
            tenant_weight=prepared.tenant_weight,
        )

    async def outputs(self, *, whole: bool = False) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, output) as the engine produces them; counts are updated on the way. `whole`: the
        caller answers only once every output is in (a non-streaming response), so each prompt's outputs
        may come merged into one (no wake-up and no detokenizer call per engine step)."""
        if len(self.prepared.prompts) == 1:
            stream = self._engine_streams[0] = self.services.engine.generate(self._engine_request(0), whole=whole)
            with self._refusals_counted(0):
                async for output in stream:
                    self._account(0, output)
                    yield 0, output
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                stream = self._engine_streams[index] = self.services.engine.generate(self._engine_request(index),
                                                                                     whole=whole)
                with self._refusals_counted(index):
                    async for output in stream:
                        self._account(index, output)  # counted on arrival: what the engine did, read or not
                        await queue.put((index, output))
            except BaseException as exc:  # handed to the consumer, which re-raises it
                await queue.put((index, exc))
            else:
                await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.prepared.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await settle(tasks)

    @contextlib.contextmanager
    def _refusals_counted(self, index: int) -> Iterator[None]:
        """An engine that refuses a prompt before queueing it (bad input, the loop down) processed none of
        it: bill nothing for it, as the engine's own counters count nothing."""
        try:
            yield
        except (InvalidRequestError, EngineDeadError):
            counts = self.prompt_counts[index]
            if counts.num_outputs == 0:
                counts.num_prompt_tokens = 0
                self._started.discard(index)  # nothing to abort
            raise

    def _account(self, prompt_index: int, output: RequestOutput) -> None:
        self._timer.on_output(output.received_at)
        counts = self.prompt_counts[prompt_index]
        counts.num_outputs += 1
        counts.num_prompt_tokens = output.num_prompt_tokens
        counts.num_cached_tokens = output.num_cached_tokens
        if output.finished and not counts.finished:
            self._num_finished += 1
        counts.finished = output.finished
        n = self.prepared.sampling.n
        echo_only = self.prepared.echo_only  # its one sampled token is not answered, so neither counted nor billed
        for delta in output.choices:
            choice = self.choices[prompt_index * n + delta.index]
            choice.num_output_tokens = 0 if echo_only else delta.num_output_tokens
            choice.num_reasoning_tokens = 0 if echo_only else delta.num_reasoning_tokens
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
                choice.stop_reason = delta.stop_reason

    @property
    def finished(self) -> bool:
        """Every prompt's last output has arrived: nothing more will come from the engine."""
        return self._num_finished == len(self.prompt_counts)

    # -- usage ------------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return sum(c.num_prompt_tokens for c in self.prompt_counts)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    def usage(self) -> dict[str, Any]:
        num_prompt = self.num_prompt_tokens
        num_output = self.num_output_tokens
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in self.prompt_counts)},
            "completion_tokens_details": {"reasoning_tokens": sum(c.num_reasoning_tokens for c in self.choices)},
        }

    # -- the end, exactly once ----------------------------------------------------------------

    def mark_aborted(self) -> None:
        self._aborted = True

    @property
    def admitted(self) -> bool:
        """Past every admission check: closing it records usage."""
        return self._admitted

    async def discard(self) -> None:
        """Abort whatever still runs and record no usage: for work that will run again from the start (a batch
        line interrupted before its result was stored), whose one usage record that later run makes."""
        self._admitted = False
        await self.close(ClientDisconnected())

    def status(self, error: BaseException | None) -> RequestStatus:
        if self._aborted or isinstance(error, ClientDisconnected | asyncio.CancelledError | GeneratorExit):
            return RequestStatus.ABORTED
        if error is not None or any(c.finish_reason in (FinishReason.ERROR, None) for c in self.choices):
            return RequestStatus.FAILED
        if any(c.finish_reason == FinishReason.LENGTH for c in self.choices):
            return RequestStatus.LENGTH
        if any(c.finish_reason == FinishReason.STOP and isinstance(c.stop_reason, str) for c in self.choices):
            return RequestStatus.STOPPED
        return RequestStatus.COMPLETED

    async def close(self, error: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        # A client disconnect cancels the streaming task (anyio cancels again at every await): without
        # the shield, the first await below would skip the usage record and the after-finish hooks.
        with anyio.CancelScope(shield=True):
            await self._close(error)

    async def _close(self, error: BaseException | None) -> None:
        services = self.services
        for index, counts in enumerate(self.prompt_counts):
            if index in self._started and not counts.finished:
                await self._abort_and_count_tail(index)
        self.prepared.admission.release()
        self._timer.flush()
        if not self._admitted:
            return
        usage = self.usage()
        services.metrics.tokens_in.inc(usage["prompt_tokens"])
        services.metrics.tokens_cached.inc(usage["prompt_tokens_details"]["cached_tokens"])
        services.metrics.tokens_out.inc(usage["completion_tokens"])
        services.metrics.tokens_reasoning.inc(usage["completion_tokens_details"]["reasoning_tokens"])
        record = self._record(error)
        log.info(
            "%s model=%s status=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft_ms=%s",
            record.kind, record.model, record.status.value, record.num_prompt_tokens, record.num_cached_tokens,
            record.num_output_tokens,
            "-" if record.time_to_first_token_s is None else f"{record.time_to_first_token_s * 1000:.1f}",
        )
        try:
            await services.rate_limiter.add_tokens(self.key.key_id, self.key.limits, usage["completion_tokens"])
        except Exception:
            log.exception("could not charge completion tokens to the rate limiter")
        for recorder in [*services.extensions.usage_recorders]:
            try:
                await recorder.record(record)
            except Exception:
                log.exception("usage recorder %r failed for %s", recorder, record.request_id)
        for hook in self.prepared.after_finish:
            try:
                await hook(record)
            except Exception:
                log.exception("after-finish hook failed for %s", record.request_id)

    async def _abort_and_count_tail(self, index: int) -> None:
        """Abort an unfinished engine request and count the outputs nobody read (billing needs them all)."""
        engine = self.services.engine
        request_id = self.engine_request_ids[index]
        stream = self._engine_streams.get(index)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # still running elsewhere: its own finally aborts it
                await stream.aclose()  # generate()'s finally aborts and keeps the unread tail
        engine.abort(request_id)
        for output in await engine.take_abandoned_outputs(request_id):
            self._account(index, output)

    def _record(self, error: BaseException | None) -> RequestRecord:
        usage = self.usage()
        prepared = self.prepared
        return RequestRecord(
            request_id=prepared.request_id,
            tenant_id=prepared.tenant_id,
            key_id=prepared.key_id,
            kind=prepared.kind,
            model=prepared.model.id,
            adapter_id=prepared.model.adapter_id,
            session_id=prepared.session_id,
            status=self.status(error),
            num_prompt_tokens=usage["prompt_tokens"],
            num_cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
            num_output_tokens=usage["completion_tokens"],
            num_reasoning_tokens=usage["completion_tokens_details"]["reasoning_tokens"],
            started_at=self.started_at,
            finished_at=time.time(),
            time_to_first_token_s=self._timer.time_to_first_token_s,
            error=None if error is None or isinstance(error, ClientDisconnected) else repr(error),
            user=getattr(prepared.body, "user", None),
            batch_id=prepared.batch_id,
        )


async def until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def settle(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Wait, shielded from the caller's own cancellation, for cancelled tasks to run their way out. Only then have
    their engine streams handed the outputs nobody read over for billing: closing the generation before that
    found nothing to count, and a client that left a non-streaming request near its end paid no output tokens."""
    pending = [task for task in tasks if not task.done()]
    if pending:
        with anyio.CancelScope(shield=True):
            await asyncio.wait(pending, timeout=_SETTLE_TIMEOUT_S)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but raise ClientDisconnected (cancelling it) the moment the client goes away."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            await settle([work_task])
    if work_task.cancelled() or not work_task.done():
        raise ClientDisconnected()
    return work_task.result()

