"""One line of a batch through the same pipeline as an online request, as background work for the engine.

The line's body is parsed by the endpoint's schema and prepared exactly as
the route prepares it (model or adapter, sessions, reasoning, response_format
and tools, chat template, context check), collected whole as a non-streaming
response, and metered by the same Generation, under the line's request id
(`<batch id>-<custom id>`). What differs:

- the engine request is `background`: the scheduler runs it on capacity
  interactive requests leave, and preempts it first;
- it takes none of the API server's in-flight slots nor the key's per-minute
  limits (the batch's own concurrency bounds it); the tenant's budget is
  reserved per line as for any request, and a spent budget is the line's 429;
- its usage is recorded only after its result is stored (`meter`), or never
  (`discard`) when it was interrupted: a line is billed once, with the answer the
  output file holds, whoever ran it and however often it was started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from loraplex.billing.quotas import QuotaExceededError
from loraplex.engine.errors import DomainError
from loraplex.platform.api.admission import UnslottedTicket
from loraplex.platform.api.chat_response import collect_chat
from loraplex.platform.api.completion_response import collect_completion
from loraplex.platform.api.generation import Generation
from loraplex.platform.api.preparation import prepare_chat, prepare_completion
from loraplex.platform.api.request_limits import check_request_limits
from loraplex.platform.api.schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.batches.line_models import LineModels
from loraplex.platform.batches.models import BatchLineRow, BatchRow
from loraplex.platform.batches.objects import answered_line, request_id_for
from loraplex.platform.batches.repository import LINE_COMPLETED, LINE_FAILED, LineResult
from loraplex.platform.batches.validation import parse_body
from loraplex.platform.deps import Principal
from loraplex.platform.errors import ApiError, error_body, status_for, validation_param
from loraplex.platform.extensions import ModelLookup, PreparedRequest, RequestRecord, RequestStatus
from loraplex.platform.ratelimit.limiter import Limits
from loraplex.platform.responses.answer import collect_response
from loraplex.platform.responses.items import ItemLimits
from loraplex.platform.responses.preparation import prepare_response
from loraplex.platform.responses.schemas import ResponseCreate
from loraplex.platform.responses.turn import ResponseTurn
from loraplex.platform.services import Services
from pydantic import ValidationError

log = logging.getLogger(__name__)
UNLIMITED = Limits(rpm=0, tpm=0)
# Refusals that pass by themselves (a grammar compile slot, a limit per minute): the line waits and runs again.
_PASSING_429_CODES = frozenset({"tenant_compile_limit", "rate_limit_exceeded", "tokens_rate_limit_exceeded"})
_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "response"}


class RetryLater(Exception):
    """The line met a passing refusal (engine overloaded, a compile slot busy): run it again later."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass(slots=True)
class LineOutcome:
    result: LineResult
    generation: Generation | None = None   # to `close` (meter) once the result is stored, or `drop`
    error: BaseException | None = None          # what ended it, for its usage record
    budget_spent: bool = False                  # the tenant's budget refused it: the rest will fail alike

    async def meter(self) -> None:
        if self.generation is not None:
            await self.generation.close(self.error)

    async def drop(self) -> None:
        if self.generation is not None:
            await self.generation.discard()


def batch_principal(batch: BatchRow) -> Principal:
    return Principal(key_id=batch.api_key_id, tenant_id=batch.tenant_id, scopes=frozenset({"inference"}),
                     limits=UNLIMITED)


async def execute_line(services: Services, batch: BatchRow, line: BatchLineRow, raw: bytes,
                       models: LineModels) -> LineOutcome:
    """Run one line to its result; raises RetryLater for a passing refusal (nothing recorded for it).
    `models`: the batch's models, resolved once for many lines."""
    request_id = request_id_for(batch.id, line.custom_id)
    key = batch_principal(batch)
    gen: Generation | None = None
    try:
        body = parse_body(batch.endpoint, json.loads(raw)["body"])
        prepared, collect = await _prepare(services, key, body, request_id, models.resolve)
        prepared.background, prepared.batch_id = True, batch.id
        gen = Generation(services, key, prepared)
        await gen.admit()
        answer = await collect(gen)
    except asyncio.CancelledError:
        if gen is not None:
            await gen.discard()
        raise
    except Exception as exc:
        return await _failed(services, request_id, line, exc, gen)
    text = answered_line(request_id, line.custom_id, status_code=200, body=answer)
    return LineOutcome(_result(line, LINE_COMPLETED, text, gen, None), gen)


async def _prepare(services: Services, key: Principal, body: Any, request_id: str, resolve_model: ModelLookup
                   ) -> tuple[Any, Any]:
    if isinstance(body, ChatCompletionRequest):
        check_request_limits(body, services.request_limits)
        prepared = await prepare_chat(services, key, body, request_id, ticket=UnslottedTicket(), resolve_model=resolve_model)
        created = int(time.time())
        return prepared, lambda gen: collect_chat(gen, texts=services.token_texts, created=created)
    if isinstance(body, CompletionRequest):
        check_request_limits(body, services.request_limits)
        prepared = await prepare_completion(services, key, body, request_id, ticket=UnslottedTicket(), resolve_model=resolve_model)
        return prepared, lambda gen: collect_completion(gen, texts=services.token_texts, tokenizer=services.tokenizer)
    return await _prepare_response(services, key, body, request_id, resolve_model)


async def _prepare_response(services: Services, key: Principal, body: ResponseCreate, request_id: str,
                            resolve_model: ModelLookup) -> tuple[PreparedRequest, Any]:
    """As POST /v1/responses, without pinning the answer's KV in the engine (nobody is waiting to continue)."""
    chains = services.extensions.domain_state["responses"]
    parent = None
    if body.previous_response_id is not None:
        parent = await chains.get(key.tenant_id, body.previous_response_id, param="previous_response_id")
    turn = ResponseTurn.build("resp_" + request_id, body, parent, created_at=int(time.time()),
                              limits=ItemLimits.from_settings(services.settings))
    prepared = await prepare_response(services, key, turn, request_id, UnslottedTicket(), pin=False,
                                       resolve_model=resolve_model)
    return prepared, lambda gen: collect_response(gen, turn=turn, chains=chains)


async def _failed(services: Services, request_id: str, line: BatchLineRow, exc: BaseException,
                  gen: Generation | None) -> LineOutcome:
    """The line's error answer (what the online route would have sent), or RetryLater for a passing refusal."""
    if isinstance(exc, ValidationError):
        param, message = validation_param(list(exc.errors()))
        status, body = 400, error_body(400, message, param=param, code="invalid_value")
    elif isinstance(exc, ApiError | DomainError):
        status = status_for(exc)
        body = error_body(status, exc.message, param=exc.param, code=exc.code)
    else:
        log.exception("batch line %s failed", request_id, exc_info=exc)
        status, body = 500, error_body(500, "internal server error", code="internal_error")
    budget_spent = isinstance(exc, QuotaExceededError)
    if status == 503 or (status == 429 and body["error"]["code"] in _PASSING_429_CODES):
        if gen is not None:
            await gen.discard()
        raise RetryLater(exc)
    ran = gen if gen is not None and gen.admitted else None
    if gen is not None and ran is None:
        await gen.close(exc)  # refused before it ran: gives back what it held, records nothing
    text = answered_line(request_id, line.custom_id, status_code=status, body=body)
    return LineOutcome(_result(line, LINE_FAILED, text, ran, exc), ran, exc, budget_spent=budget_spent)


def usage_record(batch: BatchRow, line: BatchLineRow, *, user: str | None) -> RequestRecord:
    """The usage record of a stored line whose worker died before the meter had it (the same event the
    line's run would have recorded, but for its timings)."""
    started_at = line.started_at or time.time()
    if line.usage_status is None:  # `unmetered_lines` returns only lines that ran
        raise ValueError(f"line {line.line_index} of batch {batch.id} ran nothing to bill")
    return RequestRecord(
        request_id=request_id_for(batch.id, line.custom_id), tenant_id=batch.tenant_id, key_id=batch.api_key_id,
        kind=_KINDS[batch.endpoint], model=line.model, adapter_id=line.adapter_id, session_id=None,
        status=RequestStatus(line.usage_status), num_prompt_tokens=line.input_tokens,
        num_cached_tokens=line.cached_input_tokens, num_output_tokens=line.output_tokens,
        num_reasoning_tokens=line.reasoning_tokens, started_at=started_at, finished_at=started_at,
        time_to_first_token_s=None, user=user, batch_id=batch.id,
    )


def _result(line: BatchLineRow, status: str, text: str, gen: Generation | None,
            error: BaseException | None) -> LineResult:
    result = LineResult(index=line.line_index, status=status, result=text)
    if gen is not None:
        usage = gen.usage()
        result.adapter_id = gen.prepared.model.adapter_id
        result.usage_status = str(gen.status(error))
        result.started_at = gen.started_at
        result.input_tokens = usage["prompt_tokens"]
        result.cached_input_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        result.output_tokens = usage["completion_tokens"]
        result.reasoning_tokens = usage["completion_tokens_details"]["reasoning_tokens"]
    return result
