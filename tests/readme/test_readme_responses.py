"""The Responses API block of the docs, run against the `make serve` server with the quickstart's client."""

from __future__ import annotations

import json

import openai
import pytest
from readme_examples import Example, PythonRun, named, readme_example, run_python


@pytest.fixture(scope="package")
def responses_run(make_serve, placeholders: dict[str, str], calling_run: PythonRun) -> PythonRun:
    return run_python(named("responses-python"), placeholders, namespace=dict(calling_run.namespace),
                      cwd=make_serve.workdir)


@readme_example("responses-python")
def test_responses_api_example(example: Example, responses_run: PythonRun) -> None:
    run = responses_run
    first, second = run.namespace["first"], run.namespace["second"]
    assert second.previous_response_id == first.id and second.output_text.strip()
    assert run.printed[0].startswith(second.output_text)
    assert second.usage.input_tokens_details.cached_tokens > 0   # the first turn came from pinned KV

    call = run.namespace["call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert run.namespace["answer"].output_text.strip()
    streamed = "".join(run.printed[1:])
    assert streamed.strip()

    assert run.value_of("retrieve(").output_text == second.output_text
    items = run.value_of("input_items.list(").data
    assert [item.content[0].text for item in items] == ["What is my name?"]
    client = run.namespace["client"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(second.id).output_text == second.output_text
