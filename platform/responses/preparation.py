"""A Responses API turn prepared as the chat completion it runs as, truncated to fit when asked.

Used by POST /v1/responses and by batch lines of that endpoint, so both fit the context the same way.
"""

from __future__ import annotations

import asyncio
import re

from loraplex.engine.errors import DomainError, PromptTooLongError
from loraplex.platform.api.admission import AdmissionTicket, UnslottedTicket
from loraplex.platform.api.preparation import ContextOverflowError, prepare_chat
from loraplex.platform.api.request_limits import RequestLimits, check_request_limits
from loraplex.platform.deps import Principal
from loraplex.platform.errors import ApiError
from loraplex.platform.extensions import ModelLookup, PreparedRequest
from loraplex.platform.responses.truncation import TurnCosts, turn_costs
from loraplex.platform.responses.turn import ResponseTurn
from loraplex.platform.services import Services

# The chat preparation names chat parameters in its errors; a Responses client sent these instead.
_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                     "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


async def prepare_response(services: Services, key: Principal, turn: ResponseTurn, request_id: str,
                           ticket: AdmissionTicket | UnslottedTicket, *, pin: bool = True,
                           resolve_model: ModelLookup | None = None) -> PreparedRequest:
    """The chat preparation; with truncation="auto", the oldest turns are left out until the prompt fits.

    The history is tokenized once (responses/truncation.py) and each round drops the fewest turns that cover
    what the last render was over by; the tokens of the turns left out count against the key's tokens per
    minute, also when even the newest input alone does not fit. `pin`: a stored response's KV stays pinned in
    the engine for the turn that continues it (not for batch work, which nobody continues at once); `resolve_model`:
    the caller's own model lookup (batch work).
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
                prepared = await prepare_chat(services, key, chat, request_id, ticket=ticket, resolve_model=resolve_model)
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
            except (DomainError, ApiError) as exc:
                raise _renamed(exc) from None
    finally:
        if costs is not None:
            await services.rate_limiter.add_tokens(key.key_id, key.limits, costs.num_tokens_before(turn.num_dropped))
    prepared.kind = "response"
    if turn.body.store and pin:
        prepared.session_id = turn.response_id  # the engine keeps this response's KV pinned under its id
    return prepared


def _renamed(exc: DomainError | ApiError) -> DomainError | ApiError:
    """The same error, its param in the Responses API's name (messages[3] -> input, ...), and a field's chat name
    in its message too (max_tokens -> max_output_tokens): a Responses client never sent the chat one."""
    param = exc.param or ""
    head = param.split(".", 1)[0].split("[", 1)[0]
    if head in _RESPONSES_PARAMS:
        exc.param = _RESPONSES_PARAMS[head] if head == "messages" else _RESPONSES_PARAMS[head] + param[len(head):]
        if head != "messages":  # a message's text may say "messages" as a word; input items are not messages
            exc.message = re.sub(rf"\b{head}\b", _RESPONSES_PARAMS[head], exc.message)
            exc.args = (exc.message,)
    return exc
