"""The shared tail of both generation endpoints: admit, then answer whole or as a stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from loraplex.engine.protocol import RequestOutput
from loraplex.platform.api.generation import ClientDisconnected, Generation, unless_disconnected
from loraplex.platform.api.keepalive import PrimedOutputs, prime_within
from loraplex.platform.api.sse import EventStreamResponse
from loraplex.platform.structured import relaxation_headers

# nginx's code for "client closed the request": nobody reads it, but logs and metrics do.
CLIENT_CLOSED_REQUEST = 499

Collector = Callable[[Generation], Coroutine[Any, Any, dict[str, Any]]]
Streamer = Callable[[Generation, PrimedOutputs[tuple[int, RequestOutput]]], AsyncIterator[bytes]]


async def respond(request: Request, gen: Generation, *, stream: bool, collect: Collector, streamer: Streamer) -> Response:
    await gen.admit()
    if not stream:
        try:
            body = await unless_disconnected(request, collect(gen))
        except ClientDisconnected as exc:
            gen.mark_aborted()
            await gen.close(exc)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException as exc:
            await gen.close(exc)
            raise
        await gen.close()
        return JSONResponse(body, headers=relaxation_headers(gen.prepared.metadata))
    try:
        outputs = await prime_within(request, gen.outputs(), keepalive_s=gen.services.settings.sse_keepalive_s)
        chunks = streamer(gen, outputs)  # from here on, the body closes the generation
    except ClientDisconnected as exc:
        gen.mark_aborted()
        await gen.close(exc)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException as exc:
        await gen.close(exc)
        raise
    response = EventStreamResponse(chunks)
    response.headers.update(relaxation_headers(gen.prepared.metadata))
    return response
