"""Grammar rows, plain rows and different LoRA adapters in one batch: each row gets what it gets alone."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from adapter_upload import upload_adapter
from train_adapters import ensure_trained_adapters

SCHEMA = {
    "type": "object",
    "properties": {"animal": {"type": "string", "maxLength": 20}, "legs": {"type": "integer", "minimum": 0,
                                                                          "maximum": 8}},
    "required": ["animal", "legs"], "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(start_server):
    with start_server() as running:
        yield running


def test_grammar_plain_and_adapters_mixed_greedy(server, smollm_path):
    adapters = ensure_trained_adapters(smollm_path)
    upload_adapter(server, "pirate", adapters["pirate"])
    base = server.services.base_model_name
    question = [{"role": "user", "content": "Describe a dog in JSON."}]
    requests = [
        {"model": "pirate", "messages": question, "response_format": JSON_FORMAT},
        {"model": base, "messages": question, "response_format": JSON_FORMAT},
        {"model": "pirate", "messages": question},
        {"model": base, "messages": question},
        {"model": "pirate", "messages": [{"role": "user", "content": "Yes or no?"}],
         "response_format": {"type": "choice", "choices": ["yes", "no"]}},
    ]
    client = server.client("all")
    solo = [client.chat.completions.create(max_tokens=40, temperature=0, **r).choices[0].message.content
            for r in requests]

    async def together() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=server.keys["all"],
                                          max_retries=0, timeout=600)
        try:
            answers = await asyncio.gather(*(
                async_client.chat.completions.create(max_tokens=40, temperature=0, **r) for r in requests
            ))
        finally:
            await async_client.close()
        return [a.choices[0].message.content for a in answers]

    assert asyncio.run(together()) == solo
    for text in solo[:2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert solo[2].startswith("Arr") and not solo[3].startswith("Arr")  # the adapter really applied
    assert solo[4] in ("yes", "no")
