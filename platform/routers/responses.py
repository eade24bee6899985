"""OpenAI's Responses API: POST/GET/DELETE /v1/responses and GET /v1/responses/{id}/input_items.

A request becomes a chat completion (responses/turn.py) that runs through the
same pipeline, engine path and metering as /v1/chat/completions; stored
responses chain with `previous_response_id` on pinned KV (responses/chain.py).
Scope `inference`; another tenant's response is 404.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from loraplex.engine.errors import EngineError, PromptTooLongError
from loraplex.platform.affinity import (
    affinity_headers,
    chain_key,
    previous_response_id_from,
    served_elsewhere,
)
from loraplex.platform.api.admission import AdmissionTicket, admit_early
from loraplex.platform.api.generation import Generation
from loraplex.platform.api.preparation import ContextOverflowError, prepare_chat
from loraplex.platform.api.request_limits import RequestLimits, check_request_limits
from loraplex.platform.api.respond import respond
from loraplex.platform.deps import AppServices, InferenceKey
from loraplex.platform.errors import ApiError
from loraplex.platform.extensions import PreparedRequest
from loraplex.platform.responses.answer import collect_response, stream_response
from loraplex.platform.responses.chain import ResponseChains
from loraplex.platform.responses.items import ItemLimits
from loraplex.platform.responses.schemas import ResponseCreate
from loraplex.platform.responses.truncation import TurnCosts, turn_costs
from loraplex.platform.responses.turn import ResponseTurn
from loraplex.platform.services import Services

router = APIRouter(prefix="/v1", tags=["responses"])

# The chat preparation names chat parameters in its errors; a Responses client sent these instead.
_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                     "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def _chains(services: Services) -> ResponseChains:
    return services.extensions.domain_state["responses"]


@router.post("/responses")
async def create_response(body: ResponseCreate, key: InferenceKey, services: AppServices, request: Request) -> Response:
    chains = _chains(services)
    body.previous_response_id = previous_response_id_from(request.headers, body.previous_response_id)
    ticket = await admit_early(services, key)  # before any work: reading the parent, the input, the prompt
    try:
        parent = None
        if body.previous_response_id is not None:
            parent = await chains.get(key.tenant_id, body.previous_response_id, param="previous_response_id")
        response_id = "resp_" + request.state.request_id.removeprefix("req_")
        turn = ResponseTurn.build(response_id, body, parent, created_at=int(time.time()),
                                  limits=ItemLimits.from_settings(services.settings))
        if body.store:
            await chains.check_room(key.tenant_id, parts=[turn.history, turn.input_items])
        prepared = await _prepare(services, key, turn, request.state.request_id, ticket)
    except BaseException:
        ticket.release()
        raise
    if parent is not None and served_elsewhere(parent.replica_id, services.settings.replica_id, bool(parent.pin_key)):
        services.metrics.session_turns_moved.inc()  # its KV is pinned on another replica: prefilled again here
    gen = Generation(services, key, prepared)
    response = await respond(
        request, gen, stream=body.stream,
        collect=partial(collect_response, turn=turn, chains=chains),
        streamer=partial(stream_response, turn=turn, chains=chains),
    )
    response.headers.update(affinity_headers(request.headers, chain_key(parent, response_id)))  # platform/affinity.py
    return response


async def _prepare(services: Services, key: Any, turn: ResponseTurn, request_id: str, ticket: AdmissionTicket
                   ) -> PreparedRequest:
    """The chat preparation; with truncation="auto", the oldest turns are left out until the prompt fits.

    The history is tokenized once (responses/truncation.py) and each round drops the fewest turns that cover
    what the last render was over by; the tokens of the turns left out count against the key's tokens per
    minute, also when even the newest input alone does not fit.
    """
    limits = RequestLimits.from_settings(services.settings)
    if turn.can_truncate():
        turn.fit_messages(limits.max_messages)
    costs: TurnCosts | None = None
    try:
        while True:
            try:
                chat = turn.chat_request()
                check_request_limits(chat, limits)
                prepared = await prepare_chat(services, key, chat, request_id, ticket=ticket)
                break
            except PromptTooLongError as exc:
                if not turn.can_truncate():
                    raise _renamed(exc) from None
                if not isinstance(exc, ContextOverflowError):
                    turn.truncate()
                    continue
                if costs is None:
                    costs = await asyncio.to_thread(turn_costs, services.tokenizer, turn.history)
                turn.drop_to(costs.num_messages_to_drop(num_dropped=turn.num_dropped, excess=exc.num_excess_tokens))
            except (EngineError, ApiError) as exc:
                raise _renamed(exc) from None
    finally:
        if costs is not None:
            await services.rate_limiter.add_tokens(key.key_id, key.limits, costs.num_tokens_before(turn.num_dropped))
    prepared.kind = "response"
    if turn.body.store:
        prepared.session_id = turn.response_id  # the engine keeps this response's KV pinned under its id
    return prepared


def _renamed(exc: EngineError | ApiError) -> EngineError | ApiError:
    """The same error, its param in the Responses API's name (messages[3] -> input, ...)."""
    param = exc.param or ""
    head = param.split(".", 1)[0].split("[", 1)[0]
    if head in _RESPONSES_PARAMS:
        exc.param = _RESPONSES_PARAMS[head] if head == "messages" else _RESPONSES_PARAMS[head] + param[len(head):]
    return exc


@router.get("/responses/{response_id}")
async def get_response(response_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    return (await _chains(services).get(key.tenant_id, response_id)).body


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    await _chains(services).delete(key.tenant_id, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str, key: InferenceKey, services: AppServices,
    limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    record = await _chains(services).get(key.tenant_id, response_id)
    items = record.input_items if order == "asc" else list(reversed(record.input_items))
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
