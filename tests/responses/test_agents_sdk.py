"""The OpenAI Agents SDK, with its default Responses-based model, runs an agent against our server."""

from __future__ import annotations

import json

import jsonschema
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

MODEL = "SmolLM2-135M-Instruct"

set_tracing_disabled(True)  # no trace export: nothing leaves this machine

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}


def _weather_agent(server, calls: list[dict]) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city.

        Args:
            city: The city's name.
        """
        calls.append({"city": city})
        return json.dumps({"city": city, "sky": "sunny", "celsius": 21})

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key=server.keys["all"], max_retries=0)
    return Agent(
        name="weather", instructions="Answer weather questions with the get_weather tool.", tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        # The first turn must call the tool; the SDK resets tool_choice after a tool ran, so the agent can answer.
        model_settings=ModelSettings(temperature=0, tool_choice="required", parallel_tool_calls=False,
                                     max_tokens=48),
    )


@pytest.mark.parametrize("chained", [False, True], ids=["stateless", "previous_response_id"])
async def test_agent_with_a_function_tool_runs_to_completion(server, chained):
    calls: list[dict] = []
    agent = _weather_agent(server, calls)
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                              auto_previous_response_id=chained)
    assert calls, "the agent never called its tool"
    for arguments in calls:
        jsonschema.validate(arguments, CITY_SCHEMA)
    assert isinstance(result.final_output, str) and result.final_output
    responses = result.raw_responses
    assert len(responses) >= 2 and all(r.response_id for r in responses)
    kinds = [item.type for item in result.new_items]
    assert kinds.index("tool_call_item") < kinds.index("tool_call_output_item") < kinds.index("message_output_item")
    if chained:  # the second request continued the first on the server; its prompt came mostly from pinned KV
        assert responses[1].usage.input_tokens_details.cached_tokens > 0
