"""From a validated body to `PreparedRequest`: model, sampling, the pipeline's stages, chat template, token ids.

The stages (platform/pipeline.py, in their declared order) run after the
model is resolved and before the chat template is applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import jinja2
from loraplex.engine.errors import DomainError, InvalidRequestError, PromptTooLongError
from loraplex.engine.protocol import SamplingParams
from loraplex.platform.api.admission import AdmissionTicket, UnslottedTicket, admit_early
from loraplex.platform.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from loraplex.platform.api.vllm_compat import apply_sampling_extensions, chat_template_options
from loraplex.platform.deps import Principal
from loraplex.platform.extensions import ModelLookup, PreparedRequest, ServedModel
from loraplex.platform.services import Services

# Tokenizing a long prompt on the event loop would stall every stream; short ones are cheaper inline.
_INLINE_TOKENIZE_CHARS = 2_000


def sampling_from(body: ChatCompletionRequest | CompletionRequest, *, max_tokens: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else 16,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        seed=body.seed,
        n=body.n,
        stop=stop,
        ignore_eos=body.ignore_eos,
        logit_bias=_logit_bias(body.logit_bias),
    )
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        sampling.logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sampling.max_reasoning_tokens = body.max_reasoning_tokens
    else:
        sampling.logprobs = body.logprobs
        if body.echo and body.logprobs is not None:
            sampling.prompt_logprobs = body.logprobs
    apply_sampling_extensions(body, sampling)
    sampling.validate()
    return sampling


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings; OpenAI's are token ids written in decimal."""
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        try:
            parsed[int(key)] = float(value)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids; got {key!r}", param="logit_bias") from None
    return parsed


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text content only, tool fields kept. As OpenAI's API, only an
    assistant message may leave out its content (when it calls tools), and a tool message names the call it
    answers."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None and message.role != "assistant":
            raise InvalidRequestError(f"a '{message.role}' message needs content", param=f"messages[{i}].content")
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidRequestError("a 'tool' message needs the tool_call_id of the call it answers",
                                      param=f"messages[{i}].tool_call_id")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"content part type '{part.type}' is not supported; only 'text'",
                        param=f"messages[{i}].content[{j}].type",
                    )
                texts.append(part.text)
            content = "".join(texts)
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                   for j, call in enumerate(message.tool_calls)]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _tool_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    """An earlier turn's tool call as the templates read it: {id, type, function: {name, arguments}}, the
    arguments a JSON string (an object is taken and serialised, as some frameworks send one)."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise InvalidRequestError(f'{param} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                                  '"arguments": ...}}}}', param=param)
    name, arguments = function.get("name"), function.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{param}.function.name must be a non-empty string", param=f"{param}.function.name")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments)
    if not isinstance(arguments, str):
        raise InvalidRequestError(f"{param}.function.arguments must be a JSON string",
                                  param=f"{param}.function.arguments")
    if "id" in call and not isinstance(call["id"], str):
        raise InvalidRequestError(f"{param}.id must be a string", param=f"{param}.id")
    return {**({"id": call["id"]} if "id" in call else {}), "type": "function",
            "function": {"name": name, "arguments": arguments}}


async def prepare_chat(services: Services, key: Principal, body: ChatCompletionRequest, request_id: str, *,
                       ticket: AdmissionTicket | UnslottedTicket | None = None, resolve_model: ModelLookup | None = None
                       ) -> PreparedRequest:
    """Admission first (nothing costly is done for a refused request), then the preparation. A caller that
    admitted the request itself (to prepare it more than once) passes its ticket, and releases it on error; one
    that looks models up its own way (batch work: once for many lines) passes `resolve_model`."""
    if ticket is not None:
        prepared = await _prepare_chat(services, key, body, request_id, resolve_model)
        prepared.admission = ticket
        return prepared
    ticket = await admit_early(services, key)
    with _released_on_error(ticket):
        prepared = await _prepare_chat(services, key, body, request_id, resolve_model)
    prepared.admission = ticket
    return prepared


async def prepare_completion(
    services: Services, key: Principal, body: CompletionRequest, request_id: str, *,
    ticket: AdmissionTicket | UnslottedTicket | None = None, resolve_model: ModelLookup | None = None
) -> PreparedRequest:
    """As `prepare_chat`; a caller passing its own ticket (batch work) is not admitted here."""
    if ticket is not None:
        prepared = await _prepare_completion(services, key, body, request_id, resolve_model)
        prepared.admission = ticket
        return prepared
    ticket = await admit_early(services, key, num_requests=_num_prompts(body.prompt))
    with _released_on_error(ticket):
        prepared = await _prepare_completion(services, key, body, request_id, resolve_model)
    prepared.admission = ticket
    return prepared


def _num_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """Each prompt of a list is one request (a list of token ids is one prompt)."""
    if isinstance(prompt, str) or not prompt or all(isinstance(t, int) for t in prompt):
        return 1
    return len(prompt)


async def _resolve(services: Services, key: Principal, model: str, resolve_model: ModelLookup | None) -> ServedModel:
    if resolve_model is not None:
        return await resolve_model(model)
    return await services.extensions.model_resolver.resolve(key.tenant_id, model)


@contextlib.contextmanager
def _released_on_error(ticket: AdmissionTicket) -> Iterator[None]:
    try:
        yield
    except BaseException:
        ticket.release()
        raise


async def _prepare_chat(services: Services, key: Principal, body: ChatCompletionRequest, request_id: str,
                        resolve_model: ModelLookup | None) -> PreparedRequest:
    model = await _resolve(services, key, body.model, resolve_model)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    with _named_as_sent(body):
        prepared = PreparedRequest(
            request_id=request_id, kind="chat", tenant_id=key.tenant_id, key_id=key.key_id, body=body, model=model,
            sampling=sampling_from(body, max_tokens=max_tokens), messages=chat_messages(body.messages),
            session_id=body.session_id,
            template_kwargs=chat_template_options(body, services.settings.chat_template_kwargs_max_bytes),
            priority=body.priority, tenant_weight=key.tenant_weight,
        )
        prepared.sampling.validate(len(services.tokenizer))  # top_k and token ids within the vocabulary
        await services.pipeline.run(prepared)
        tokens = await _maybe_off_loop(_apply_chat_template, services.tokenizer, prepared, size=_chat_size(prepared))
        prepared.prompts = [tokens]
        _fit_context(services, prepared, explicit_max_tokens=max_tokens is not None)
    return prepared


@contextlib.contextmanager
def _named_as_sent(body: ChatCompletionRequest) -> Iterator[None]:
    """An error about the token limit names `max_completion_tokens` where the client sent that field (the
    sampling parameters and the context check know the limit as max_tokens, which chat clients may send too)."""
    try:
        yield
    except DomainError as exc:
        if body.max_completion_tokens is not None and exc.param == "max_tokens":
            exc.param = "max_completion_tokens"
            exc.message = exc.message.replace("max_tokens", "max_completion_tokens")
            exc.args = (exc.message,)
        raise


async def _prepare_completion(
    services: Services, key: Principal, body: CompletionRequest, request_id: str, resolve_model: ModelLookup | None
) -> PreparedRequest:
    model = await _resolve(services, key, body.model, resolve_model)
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    # max_tokens 0 with echo scores the prompt (its text and logprobs back, nothing generated), as OpenAI's legacy
    # completions and the evaluation harnesses built on them do. The engine always samples a token: one is asked
    # for and left out of the answer, its usage and its bill.
    echo_only = body.max_tokens == 0
    if echo_only and not body.echo:
        raise InvalidRequestError("max_tokens must be at least 1, or 0 with echo=true (the prompt back with its "
                                  "logprobs, nothing generated)", param="max_tokens")
    prepared = PreparedRequest(
        request_id=request_id, kind="completion", tenant_id=key.tenant_id, key_id=key.key_id, body=body, model=model,
        sampling=sampling_from(body, max_tokens=1 if echo_only else body.max_tokens),
        priority=body.priority, tenant_weight=key.tenant_weight, echo_only=echo_only,
    )
    if echo_only:
        prepared.sampling.logprobs = None  # the sampled token's logprobs are not returned
    prepared.sampling.validate(len(services.tokenizer))  # top_k and token ids within the vocabulary
    await services.pipeline.run(prepared)
    size = sum(len(p) for p in body.prompt if isinstance(p, str)) if isinstance(body.prompt, list) else len(body.prompt)
    prepared.prompts = await _maybe_off_loop(_tokenize_prompts, services.tokenizer, body.prompt, size=size)
    _fit_context(services, prepared, explicit_max_tokens=body.max_tokens is not None)
    return prepared


async def _maybe_off_loop(fn: Any, *args: Any, size: int) -> Any:
    if size <= _INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _chat_size(prepared: PreparedRequest) -> int:
    """About how many characters the template renders: the messages' content, earlier turns' tool calls and the
    offered tools (a template that renders them itself), so none of them is tokenized on the event loop."""
    size = 0
    for message in prepared.messages or []:
        size += len(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            size += len(call["function"]["name"]) + len(call["function"]["arguments"])
    if prepared.template_kwargs.get("tools"):
        size += _INLINE_TOKENIZE_CHARS + 1  # tools rendered by the template (up to grammar_max_spec_bytes): a thread
    return size


def _apply_chat_template(tokenizer: Any, prepared: PreparedRequest) -> list[int]:
    return render_chat_prompt(tokenizer, prepared.messages or [], prepared.template_kwargs)


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
    """The prompt's token ids; a template that refuses the conversation is a 400 naming `messages`."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, **{"add_generation_prompt": True, **template_kwargs}
        )
    except jinja2.TemplateError as exc:
        # A template's raise_exception(...) judges the conversation (roles out of order, a role it lacks...)
        raise InvalidRequestError(f"the model's chat template refused these messages: {exc}", param="messages") from None
    except (TypeError, ValueError) as exc:
        # The template met a value of a type it does not handle (a tenant's variable, a field of a message), or
        # transformers found the rendered prompt not to end with the message to continue (continue_final_message)
        raise InvalidRequestError(f"the model's chat template could not render these messages: {exc}",
                                  param="messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _tokenize_prompts(tokenizer: Any, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        raw: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        raw = [list(prompt)]  # type: ignore[arg-type]
    else:
        raw = list(prompt)  # type: ignore[arg-type]
    if not raw:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    vocab_size = len(tokenizer)
    prompts: list[list[int]] = []
    for i, item in enumerate(raw):
        ids = list(tokenizer(item, add_special_tokens=False)["input_ids"]) if isinstance(item, str) else item
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt" if len(raw) == 1 else f"prompt[{i}]")
        if any(not 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab_size})", param="prompt")
        prompts.append(ids)
    return prompts


class ContextOverflowError(PromptTooLongError):
    """The prompt is `num_excess_tokens` longer than the context leaves it (truncation plans from this)."""

    def __init__(self, message: str, *, param: str, num_excess_tokens: int) -> None:
        super().__init__(message, param=param)
        self.num_excess_tokens = num_excess_tokens


def _fit_context(services: Services, prepared: PreparedRequest, *, explicit_max_tokens: bool) -> None:
    """400 for a prompt that can never fit; an unset chat max_tokens takes what the context leaves."""
    max_model_len = services.engine.max_model_len
    longest = max(len(p) for p in prepared.prompts)
    if longest >= max_model_len:
        raise ContextOverflowError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {longest}",
            param="messages" if prepared.kind == "chat" else "prompt",
            num_excess_tokens=longest - max_model_len + (prepared.sampling.max_tokens if explicit_max_tokens else 1),
        )
    room = max_model_len - longest
    if not explicit_max_tokens:
        prepared.sampling.max_tokens = room if prepared.kind == "chat" else min(prepared.sampling.max_tokens, room)
    elif prepared.sampling.max_tokens > room:
        raise ContextOverflowError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {longest} "
            f"and max_tokens asks for {prepared.sampling.max_tokens} more",
            param="max_tokens", num_excess_tokens=prepared.sampling.max_tokens - room,
        )
