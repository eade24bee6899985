"""OpenAI's Responses API: POST/GET/DELETE /v1/responses and GET /v1/responses/{id}/input_items.

A request becomes a chat completion (responses/turn.py) that runs through the
same pipeline, engine path and metering as /v1/chat/completions; stored
responses chain with `previous_response_id` on pinned KV (responses/chain.py).
Scope `inference`; another tenant's response is 404.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from loraplex.platform.affinity import (
    affinity_headers,
    chain_key,
    previous_response_id_from,
    served_elsewhere,
)
from loraplex.platform.api.admission import admit_early
from loraplex.platform.api.generation import Generation
from loraplex.platform.api.respond import respond
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.deps import AppServices, InferenceKey
from loraplex.platform.responses.answer import collect_response, stream_response
from loraplex.platform.responses.chain import ResponseChains
from loraplex.platform.responses.items import ItemLimits
from loraplex.platform.responses.preparation import prepare_response
from loraplex.platform.responses.schemas import ResponseCreate
from loraplex.platform.responses.turn import ResponseTurn
from loraplex.platform.services import Services

router = APIRouter(prefix="/v1", tags=["responses"], route_class=StrictJSONRoute)


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
        prepared = await prepare_response(services, key, turn, request.state.request_id, ticket)
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
