"""What every SSE body ends with: metering closed first, then usage and [DONE]; errors as an `error` event.

The events of the engine's last outputs, the usage chunk and `[DONE]` go out
in one write: once the engine has finished the request, nothing more is
awaited from it, so holding them back until the generation is closed delays
nothing but saves a write (and a wake-up of the client) per event.

Both generation endpoints stream through `finish_stream`. The generation is
closed (usage metered durably, session pinned, engine request released)
*before* the last chunk goes out, so a client that saw `[DONE]` has been
billed, even if the server dies a moment later. If the body fails, the
client gets an OpenAI-shaped error event and the generation is closed with
that error; however the response ends, it is closed exactly once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from loraplex.engine.errors import DomainError, EngineError
from loraplex.engine.protocol import RequestOutput
from loraplex.platform.api.generation import Generation
from loraplex.platform.api.keepalive import PrimedOutputs
from loraplex.platform.api.sse import DONE, sse_error
from loraplex.platform.errors import ApiError, status_for


class ChoiceFailed(EngineError):
    """One choice's engine request failed after the response started (a 500 by the error table)."""

    code = "generation_failed"


async def finish_stream(
    gen: Generation, chunks: AsyncIterator[bytes], *, usage_chunk: Callable[[], bytes] | None,
    outputs: PrimedOutputs[tuple[int, RequestOutput]] | None = None,
) -> AsyncIterator[bytes]:
    """`outputs`, the generation's primed outputs, may still await their first: keep-alives go out meanwhile."""
    error: BaseException | None = None
    tail = b""
    try:
        if outputs is not None:
            async for comment in outputs.keepalives():
                yield comment
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for data in chunks:
                if gen.finished:  # the engine is done: what is left goes out with the usage and [DONE], at once
                    tail += data
                else:
                    yield data
        await gen.close()
        if usage_chunk is not None:
            tail += usage_chunk()
        yield tail + DONE
    except (ApiError, DomainError) as exc:
        error = exc
        yield tail + sse_error(status_for(exc), exc.message, code=exc.code)
    except BaseException as exc:
        error = exc
        raise
    finally:
        if outputs is not None:
            await outputs.aclose()
        await gen.close(error)
