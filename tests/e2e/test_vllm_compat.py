"""vLLM's request extensions through the `openai` SDK (`extra_body`), as people migrating from vLLM send them.

Outputs are forced by our grammars, so every structured answer validates even on SmolLM2-135M.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from e2e_helpers import HELLO, MODEL

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SAY_OK = [{"role": "user", "content": "Say OK."}]


def _chat(client, **extra):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40, temperature=0, extra_body=extra)


def _bad(call, param: str) -> openai.BadRequestError:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as raised:
        call()
    assert raised.value.param == param, raised.value.body
    return raised.value


# ---- structured output ---------------------------------------------------------------------------

@pytest.mark.parametrize("schema", [PERSON, json.dumps(PERSON)], ids=["object", "json-text"])
def test_guided_json(openai_client, schema) -> None:  # type: ignore[no-untyped-def]
    reply = _chat(openai_client, guided_json=schema)
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_guided_regex_choice_and_grammar(openai_client) -> None:  # type: ignore[no-untyped-def]
    regex = _chat(openai_client, guided_regex=r"[0-9]{3}-[a-z]{2}").choices[0].message.content
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex)
    choice = _chat(openai_client, guided_choice=["red", "green", "blue"]).choices[0].message.content
    assert choice in {"red", "green", "blue"}
    grammar = _chat(openai_client, guided_grammar='root ::= "yes" | "no"').choices[0].message.content
    assert grammar in {"yes", "no"}


def test_structured_outputs_object(openai_client) -> None:  # type: ignore[no-untyped-def]
    person = _chat(openai_client, structured_outputs={"json": PERSON}).choices[0].message.content
    jsonschema.validate(json.loads(person), PERSON)
    choice = _chat(openai_client, structured_outputs={"choice": ["cat", "dog"]}).choices[0].message.content
    assert choice in {"cat", "dog"}
    regex = _chat(openai_client, structured_outputs={"regex": r"[A-Z]{4}"}).choices[0].message.content
    assert re.fullmatch(r"[A-Z]{4}", regex)
    # Free-form JSON: SmolLM2 rarely closes it within a small budget; the grammar makes it start as an object.
    unconstrained = _chat(openai_client).choices[0].message.content
    anything = _chat(openai_client, structured_outputs={"json_object": True}).choices[0].message.content
    assert not unconstrained.lstrip().startswith("{") and anything.lstrip().startswith("{")


def test_guided_choice_on_completions(openai_client) -> None:  # type: ignore[no-untyped-def]
    completion = openai_client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0,
                                                  extra_body={"guided_choice": ["blue", "green"]})
    assert completion.choices[0].text in {"blue", "green"}


def test_structured_output_mistakes_name_the_field(openai_client) -> None:  # type: ignore[no-untyped-def]
    _bad(lambda: _chat(openai_client, guided_json=PERSON, guided_regex="a+"), "guided_regex")
    _bad(lambda: openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, response_format={"type": "json_object"},
        extra_body={"guided_choice": ["a"]}), "guided_choice")
    _bad(lambda: _chat(openai_client, guided_choice=[]), "guided_choice")
    _bad(lambda: _chat(openai_client, guided_json="{not json"), "guided_json")
    _bad(lambda: _chat(openai_client, structured_outputs={"structural_tag": "{}"}), "structured_outputs.structural_tag")
    _bad(lambda: _chat(openai_client, structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs")


# ---- sampling ------------------------------------------------------------------------------------

def test_min_tokens_outlasts_an_early_eos(openai_client) -> None:  # type: ignore[no-untyped-def]
    base = openai_client.chat.completions.create(model=MODEL, messages=SAY_OK, max_tokens=60, temperature=0)
    assert base.choices[0].finish_reason == "stop"
    want = base.usage.completion_tokens + 8
    longer = openai_client.chat.completions.create(model=MODEL, messages=SAY_OK, max_tokens=60, temperature=0,
                                                   extra_body={"min_tokens": want})
    assert longer.usage.completion_tokens >= want
    _bad(lambda: openai_client.chat.completions.create(model=MODEL, messages=SAY_OK, max_tokens=5,
                                                       extra_body={"min_tokens": 6}), "min_tokens")


def test_stop_token_ids_and_include_stop_str_in_output(openai_client, api_server) -> None:  # type: ignore[no-untyped-def]
    tokenizer = api_server.services.tokenizer
    (seven,) = tokenizer.encode("7", add_special_tokens=False)

    def complete(**extra):  # type: ignore[no-untyped-def]
        return openai_client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0,
                                                extra_body=extra).choices[0]

    full = complete().text
    assert full.startswith(" 6, 7, 8")
    by_token = complete(stop_token_ids=[seven])
    assert by_token.text == " 6, " and by_token.finish_reason == "stop"
    assert complete(stop_token_ids=[seven], include_stop_str_in_output=True).text == " 6, 7"
    assert complete(stop=["8"]).text == " 6, 7, "
    assert complete(stop=["8"], include_stop_str_in_output=True).text == " 6, 7, 8"


def test_skip_special_tokens_false_shows_them(openai_client, api_server) -> None:  # type: ignore[no-untyped-def]
    eos = api_server.services.tokenizer.eos_token  # <|im_end|>
    eos_id = api_server.services.tokenizer.eos_token_id
    common = {"ignore_eos": True, "stop_token_ids": [eos_id], "include_stop_str_in_output": True}
    shown, hidden = (openai_client.chat.completions.create(
        model=MODEL, messages=SAY_OK, max_tokens=40, temperature=0, extra_body={**common, **skip},
    ).choices[0].message.content for skip in ({"skip_special_tokens": False}, {}))
    if not shown.endswith(eos):
        pytest.fail(f"the answer did not end at the EOS id within 40 tokens: {shown!r}")
    assert shown == hidden + eos


# ---- chat template ---------------------------------------------------------------------------------

def test_continue_final_message_and_add_generation_prompt(openai_client, api_server) -> None:  # type: ignore[no-untyped-def]
    tokenizer = api_server.services.tokenizer
    prefix = [*SAY_OK, {"role": "assistant", "content": "The answer is"}]
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=prefix, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    rendered = tokenizer.apply_chat_template(prefix, continue_final_message=True, tokenize=False)
    assert rendered.endswith("The answer is")
    assert reply.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    without_header = openai_client.chat.completions.create(
        model=MODEL, messages=SAY_OK, max_tokens=1, extra_body={"add_generation_prompt": False})
    with_header = openai_client.chat.completions.create(model=MODEL, messages=SAY_OK, max_tokens=1)
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert with_header.usage.prompt_tokens - without_header.usage.prompt_tokens == len(header)
    _bad(lambda: openai_client.chat.completions.create(
        model=MODEL, messages=SAY_OK, max_tokens=2, extra_body={"continue_final_message": True}),
        "continue_final_message")


def test_chat_template_kwargs(openai_client) -> None:  # type: ignore[no-untyped-def]
    plain = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    # SmolLM2's template reads no variables: an unused one is harmless, as in vLLM.
    with_kwargs = _chat(openai_client, chat_template_kwargs={"enable_thinking": False})
    assert with_kwargs.usage.prompt_tokens == plain.usage.prompt_tokens
    _bad(lambda: _chat(openai_client, chat_template_kwargs={"chat_template": "{{ 'pwned' }}"}),
         "chat_template_kwargs.chat_template")
    _bad(lambda: _chat(openai_client, chat_template_kwargs={"tokenize": True}), "chat_template_kwargs.tokenize")
