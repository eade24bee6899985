"""OpenAI-compatible inference routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import time
from functools import partial

from fastapi import APIRouter, Request, Response
from loraplex.platform.affinity import affinity_headers, session_id_from
from loraplex.platform.api.chat_response import collect_chat, stream_chat
from loraplex.platform.api.completion_response import collect_completion, stream_completion
from loraplex.platform.api.generation import Generation
from loraplex.platform.api.preparation import prepare_chat, prepare_completion
from loraplex.platform.api.request_limits import check_request_limits
from loraplex.platform.api.respond import respond
from loraplex.platform.api.schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.deps import AppServices, InferenceKey
from loraplex.platform.extensions import ServedModel
from loraplex.platform.services import Services

router = APIRouter(prefix="/v1", tags=["openai"], route_class=StrictJSONRoute)


@router.get("/models")
async def list_models(key: InferenceKey, services: AppServices) -> dict:
    models = await services.extensions.model_resolver.list_models(key.tenant_id)
    return {
        "object": "list",
        "data": [_model_public(m, services.base_model_name) for m in models],
    }


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, key: InferenceKey, services: AppServices) -> dict:
    model = await services.extensions.model_resolver.resolve(key.tenant_id, model_id)
    return _model_public(model, services.base_model_name)


def _model_public(model: ServedModel, base_model_name: str) -> dict:
    """An adapter names the base model it runs on as its `parent` (the base model has none)."""
    parent = base_model_name if model.adapter_id is not None else None
    return {"id": model.id, "object": "model", "created": model.created, "owned_by": model.owned_by, "parent": parent}


# The generation routes take their services from the app, not as a dependency: FastAPI resolves every declared
# dependency on every request, and these two routes carry most of the traffic.
@router.post("/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, key: InferenceKey, request: Request) -> Response:
    services: Services = request.app.state.services
    check_request_limits(body, services.request_limits)
    body.session_id = session_id_from(request.headers, body.session_id)
    prepared = await prepare_chat(services, key, body, request.state.request_id)
    gen = Generation(services, key, prepared)
    response = await respond(
        request, gen, stream=body.stream,
        collect=partial(collect_chat, texts=services.token_texts, created=int(time.time())),
        streamer=partial(stream_chat, texts=services.token_texts),
    )
    response.headers.update(affinity_headers(request.headers, prepared.session_id))  # platform/affinity.py
    return response


@router.post("/completions")
async def create_completion(body: CompletionRequest, key: InferenceKey, request: Request) -> Response:
    services: Services = request.app.state.services
    check_request_limits(body, services.request_limits)
    prepared = await prepare_completion(services, key, body, request.state.request_id)
    gen = Generation(services, key, prepared)
    return await respond(
        request, gen, stream=body.stream,
        collect=partial(collect_completion, texts=services.token_texts, tokenizer=services.tokenizer),
        streamer=partial(stream_completion, texts=services.token_texts, tokenizer=services.tokenizer),
    )
