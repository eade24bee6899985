"""The declared request pipeline: stage order, typed additions, parsers composed once.

The case that motivated declaring the order: a session turn whose tools come from the
session (not the request) on a model with reasoning markers. The reasoning stage must
see the session's tools, so an unprompted turn gets a plain (ungated) grammar, as the
reasoning code intends for models that do not think unless asked to.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from loraplex.engine.protocol import SamplingParams
from loraplex.grammar.runtime.reasoning_gate import ReasoningGatedGrammar
from loraplex.platform.api.schemas import ChatCompletionRequest
from loraplex.platform.extensions import PreparedRequest, ServedModel
from loraplex.platform.pipeline import STAGE_ORDER, RequestPipeline, StageAdditions
from loraplex.platform.reasoning import build_reasoning
from loraplex.platform.sessions_domain import SessionStage
from loraplex.platform.settings import Settings
from loraplex.platform.structured import build_structured_output
from loraplex.sessions.memory_store import MemorySessionStore
from loraplex.sessions.store import SessionRecord
from loraplex.sessions.turns import AnswerCapture, SessionTurns

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tokenizer(smollm_path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path)


@pytest.fixture(scope="module")
def structured_stage(tokenizer: Any) -> Any:
    stage = build_structured_output(tokenizer, len(tokenizer))
    yield stage
    stage.compiler.close()


def _pipeline(tokenizer: Any, structured_stage: Any, turns: SessionTurns) -> RequestPipeline:
    reasoning = build_reasoning(Settings(reasoning_format="think"), tokenizer, "llama")
    assert reasoning is not None
    # Registered in the reverse of the declared order, on purpose: registration order must not matter.
    return RequestPipeline({"structured_output": structured_stage, "reasoning": reasoning,
                            "session": SessionStage(turns)})


def _session_turn(turns: SessionTurns, **body: Any) -> PreparedRequest:
    session = SessionRecord(id="sess_order", tenant_id="t1", model=MODEL, tools=TOOLS, tool_choice="required")
    turns.store.create(session)
    request = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                    session_id=session.id, **body)
    return PreparedRequest(request_id="req-1", kind="chat", tenant_id="t1", key_id="k1", body=request,
                           model=ServedModel(id=MODEL), sampling=SamplingParams(max_tokens=32),
                           messages=[{"role": "user", "content": "Weather in Paris?"}], session_id=session.id)


def _turns() -> SessionTurns:
    return SessionTurns(MemorySessionStore(), replica_id="r1", lease_s=30, release=lambda _key: None, busy_wait_s=0)


def test_session_tools_reach_the_reasoning_stage_so_the_grammar_is_not_gated(tokenizer, structured_stage):
    turns = _turns()
    pipeline = _pipeline(tokenizer, structured_stage, turns)
    assert pipeline.names == ["session", "reasoning", "structured_output"]
    prepared = _session_turn(turns)

    asyncio.run(pipeline.run(prepared))

    assert prepared.body.tools == TOOLS and prepared.body.tool_choice == "required"  # from the session
    assert prepared.grammar is not None and not isinstance(prepared.grammar, ReasoningGatedGrammar)
    assert prepared.reasoning is None and prepared.sampling.max_reasoning_tokens is None
    assert prepared.messages[-1] == {"role": "user", "content": "Weather in Paris?"}


def test_asking_for_reasoning_gates_the_session_grammar(tokenizer, structured_stage):
    turns = _turns()
    prepared = _session_turn(turns, reasoning_effort="low")

    asyncio.run(_pipeline(tokenizer, structured_stage, turns).run(prepared))

    assert isinstance(prepared.grammar, ReasoningGatedGrammar)
    assert prepared.reasoning is not None and prepared.sampling.max_reasoning_tokens is not None


def test_session_capture_wraps_the_tool_parser_so_the_transcript_keeps_tool_calls(tokenizer, structured_stage):
    turns = _turns()
    prepared = _session_turn(turns)
    asyncio.run(_pipeline(tokenizer, structured_stage, turns).run(prepared))

    parser = prepared.parser_factory()
    assert isinstance(parser, AnswerCapture)
    parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    _, finish_reason = parser.finish("stop")

    assert finish_reason == "tool_calls"
    message = parser.message()
    assert message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert '"Paris"' in message["tool_calls"][0]["function"]["arguments"]


def test_the_request_body_given_to_the_client_code_is_not_edited(tokenizer, structured_stage):
    turns = _turns()
    prepared = _session_turn(turns)
    original = prepared.body
    asyncio.run(_pipeline(tokenizer, structured_stage, turns).run(prepared))
    assert original.tools is None and prepared.body is not original


def test_an_undeclared_stage_is_refused():
    async def stage(_prepared: PreparedRequest) -> StageAdditions | None:
        return None

    with pytest.raises(ValueError, match="unknown pipeline stages"):
        RequestPipeline({"sessions": stage})
    assert RequestPipeline({name: stage for name in STAGE_ORDER}).names == list(STAGE_ORDER)
