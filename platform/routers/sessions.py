"""Sessions: the /v1/sessions routes (the chat-completions side is platform/sessions_domain.py).

Scope `inference`; another tenant's session is 404.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.affinity import affinity_headers
from loraplex.platform.api.json_types import JSONInt
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.deps import AppServices, InferenceKey
from loraplex.sessions.limits import SessionLimits, check_session_create
from loraplex.sessions.store import KVState, SessionRecord, new_session_id
from loraplex.sessions.turns import SessionTurns
from pydantic import BaseModel, ConfigDict

router = APIRouter(prefix="/v1", tags=["sessions"], route_class=StrictJSONRoute)


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field (`ttl`) is a 400, not a silent default

    model: str
    system: str | None = None
    ttl_seconds: JSONInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


def session_public(record: SessionRecord, *, with_transcript: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": record.id,
        "object": "session",
        "model": record.model,
        "created_at": int(record.created_at),
        "expires_at": int(record.expires_at),
        "ttl_seconds": record.ttl_seconds,
        "system": record.system,
        "tools": record.tools,
        "tool_choice": record.tool_choice,
        "response_format": record.response_format,
        "num_turns": record.num_turns,
        "num_tokens": record.num_tokens,
        "kv_state": record.kv_state,
        "replica_id": record.replica_id,
        "version": record.version,
        "last_turn": {"prompt_tokens": record.last_prompt_tokens, "cached_tokens": record.last_cached_tokens,
                      "completion_tokens": record.last_output_tokens},
    }
    if with_transcript:
        body["messages"] = record.messages
    return body


def _turns(services: Any) -> SessionTurns:
    return services.extensions.domain_state["sessions"]


@router.post("/sessions")
async def create_session(body: SessionCreate, key: InferenceKey, services: AppServices, request: Request,
                         response: Response) -> dict[str, Any]:
    settings = services.settings
    ttl = settings.session_ttl_s if body.ttl_seconds is None else body.ttl_seconds
    if not 1 <= ttl <= settings.session_max_ttl_s:
        raise InvalidRequestError(f"ttl_seconds must be in [1, {settings.session_max_ttl_s}]", param="ttl_seconds")
    limits = SessionLimits.from_settings(settings)
    await asyncio.to_thread(check_session_create, body.system, body.tools, body.tool_choice, body.response_format,
                            limits)
    model = await services.extensions.model_resolver.resolve(key.tenant_id, body.model)
    record = SessionRecord(
        id=new_session_id(), tenant_id=key.tenant_id, model=model.id, adapter_id=model.adapter_id,
        system=body.system, tools=body.tools, tool_choice=body.tool_choice, response_format=body.response_format,
        ttl_seconds=ttl,
    )
    turns = _turns(services)
    await asyncio.to_thread(turns.store.create, record, max_per_tenant=settings.max_sessions_per_tenant,
                            quota=turns.quota)
    response.headers.update(affinity_headers(request.headers, record.id))  # balancers learn the key (affinity.py)
    return session_public(record)


@router.get("/sessions")
async def list_sessions(
    key: InferenceKey, services: AppServices,
    limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
) -> dict[str, Any]:
    page = await asyncio.to_thread(_turns(services).store.list, key.tenant_id, limit=limit, after=after)
    return {
        "object": "list", "data": [session_public(r, with_transcript=False) for r in page.data],
        "has_more": page.has_more, "first_id": page.first_id, "last_id": page.last_id,
    }


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    record = await asyncio.to_thread(_turns(services).store.get, key.tenant_id, session_id)
    if record.kv_state != KVState.NONE and record.replica_id == services.settings.replica_id:
        record.kv_state = await services.engine.session_state(record.id)  # the engine knows where this replica's KV is
    return session_public(record)


@router.delete("/sessions/{session_id}")
async def delete_session(session_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    await asyncio.to_thread(_turns(services).delete, key.tenant_id, session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}
