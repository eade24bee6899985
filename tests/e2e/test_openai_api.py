"""The official `openai` client against a real uvicorn server on the SmolLM2 engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Name three colours."}]


def engine_counters(server) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    stats = server.services.engine.stats()
    return stats["prompt_tokens_total"], stats["generation_tokens_total"]


def test_models_lists_the_base_model(openai_client) -> None:  # type: ignore[no-untyped-def]
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert openai_client.models.retrieve(MODEL).id == MODEL


def test_chat_non_streaming(openai_client, api_server) -> None:  # type: ignore[no-untyped-def]
    tokenizer = api_server.services.tokenizer
    before = engine_counters(api_server)
    reply = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    after = engine_counters(api_server)

    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    expected_prompt = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    num_prompt = len(tokenizer(expected_prompt, add_special_tokens=False)["input_ids"])
    # Usage equals what the engine actually processed, counted by the engine itself.
    assert reply.usage.prompt_tokens == num_prompt == after[0] - before[0]
    assert reply.usage.completion_tokens == after[1] - before[1]
    assert 12 >= reply.usage.completion_tokens >= 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_chat_streaming_matches_non_streaming(openai_client) -> None:  # type: ignore[no-untyped-def]
    whole = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0)
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2
    assert "".join(c.choices[0].delta.content for c in content_chunks) == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_streaming_wire_format(api_server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {api_server.keys['inference']}"}
    with httpx.stream("POST", api_server.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("req_")
        events = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0].removeprefix("data: "))
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first  # only present when stream_options.include_usage is set


def test_completions_string_and_list_prompts(openai_client, api_server) -> None:  # type: ignore[no-untyped-def]
    tokenizer = api_server.services.tokenizer
    single = openai_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert single.object == "text_completion" and single.choices[0].text
    assert single.usage.completion_tokens == 5 and single.choices[0].finish_reason == "length"
    batch = openai_client.completions.create(
        model=MODEL, prompt=["The capital of France is", "One, two, three,"], max_tokens=5, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == single.choices[0].text
    num_second = len(tokenizer("One, two, three,", add_special_tokens=False)["input_ids"])
    assert batch.usage.prompt_tokens == single.usage.prompt_tokens + num_second
    assert batch.usage.completion_tokens == 10


def test_completions_echo_and_logprobs(openai_client, api_server) -> None:  # type: ignore[no-untyped-def]
    prompt = "The sky is"
    reply = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    num_prompt = len(api_server.services.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == num_prompt + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text
    # Greedy: every generated token is the best alternative.
    for token, lp, top in zip(logprobs.tokens[num_prompt:], logprobs.token_logprobs[num_prompt:],
                              logprobs.top_logprobs[num_prompt:], strict=True):
        assert max(top.values()) == pytest.approx(lp, abs=1e-4) and token in top


def test_completions_echo_with_several_choices_gives_each_the_prompt_and_its_own_answer(openai_client, api_server) -> None:  # type: ignore[no-untyped-def]
    """n choices of one prompt share its echoed part (built once), then each goes on with its own tokens and
    offsets, streamed or not."""
    prompt = "Colours of the rainbow:"
    num_prompt = len(api_server.services.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    reply = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=3, temperature=1.0, seed=7,
                                             echo=True, logprobs=1)
    assert len(reply.choices) == 3
    prompt_parts = set()
    for choice in reply.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == num_prompt + 4 and "".join(logprobs.tokens) == choice.text
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
        prompt_parts.add(json.dumps([logprobs.tokens[:num_prompt], logprobs.token_logprobs[:num_prompt],
                                     logprobs.top_logprobs[:num_prompt]]))
    assert len(prompt_parts) == 1 and reply.choices[0].logprobs.token_logprobs[0] is None
    assert len({choice.text for choice in reply.choices}) > 1  # each its own answer after the shared prompt

    streamed = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=3, temperature=1.0,
                                                seed=7, echo=True, logprobs=1, stream=True)
    tokens: dict[int, list[str]] = {}
    for chunk in streamed:
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
    assert sorted(tokens) == [0, 1, 2]
    assert all(len(t) == num_prompt + 4 and t[:num_prompt] == reply.choices[0].logprobs.tokens[:num_prompt]
               for t in tokens.values())


def test_completions_echo_with_max_tokens_0_scores_the_prompt(openai_client, api_server) -> None:  # type: ignore[no-untyped-def]
    """echo + max_tokens 0, as the evaluation harnesses score a text: the prompt back with its logprobs, nothing
    generated, no completion tokens; its logprobs are those a generating request gets for the same prompt."""
    prompt = "The capital of France is Paris"
    num_prompt = len(api_server.services.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    scored = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                              temperature=0)
    generating = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=1,
                                                  temperature=0)
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == num_prompt and "".join(choice.logprobs.tokens) == prompt
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        generating.choices[0].logprobs.token_logprobs[1:num_prompt], abs=1e-4)
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (num_prompt, 0)

    streamed = list(openai_client.completions.create(model=MODEL, prompt=[prompt, "Hello"], max_tokens=0, echo=True,
                                                     stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: prompt, 1: "Hello"}
    finishes = [c.finish_reason for chunk in streamed for c in chunk.choices if c.finish_reason]
    assert finishes == ["length", "length"]
    assert streamed[-1].usage.completion_tokens == 0

    with pytest.raises(openai.BadRequestError) as refused:  # without echo, max_tokens 0 asks for nothing
        openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens" and "echo" in refused.value.body["message"]


def test_completions_streaming(openai_client) -> None:  # type: ignore[no-untyped-def]
    whole = openai_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    chunks = list(openai_client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_logprobs(openai_client) -> None:  # type: ignore[no-untyped-def]
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_n_two_choices(openai_client) -> None:  # type: ignore[no-untyped-def]
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, n=2, temperature=1.0, seed=7, logprobs=True
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content for c in reply.choices)
    assert reply.choices[0].message.content != reply.choices[1].message.content
    # One prompt, counted once; completion tokens summed over both choices.
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)
    streamed = list(openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, n=2, temperature=1.0, seed=7, logprobs=True, stream=True
    ))
    by_index: dict[int, str] = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert [by_index[0], by_index[1]] == [c.message.content for c in reply.choices]


def test_stop_string_ends_the_choice(openai_client) -> None:  # type: ignore[no-untyped-def]
    free = openai_client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    text = free.choices[0].text
    assert "," in text
    stop = text[text.index(",") :][:2].strip() or ","
    stopped = openai_client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)
    assert stopped.usage.completion_tokens < free.usage.completion_tokens


def test_seed_reproducibility(openai_client) -> None:  # type: ignore[no-untyped-def]
    def sample(seed: int) -> str:
        reply = openai_client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed
        )
        return reply.choices[0].message.content

    first, again, other = sample(1234), sample(1234), sample(4321)
    assert first == again
    assert first != other


def test_unknown_fields_are_refused_by_name(api_server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "temperature": 0, "some_future_field": {"x": 1}}
    r = httpx.post(api_server.base_url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {api_server.keys['inference']}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "some_future_field" and r.json()["error"]["code"] == "unknown_parameter"


def test_logit_bias_forces_and_bans_tokens_through_the_api(openai_client, api_server) -> None:  # type: ignore[no-untyped-def]
    tokenizer = api_server.services.tokenizer
    (blue,) = tokenizer.encode(" blue", add_special_tokens=False)
    forced = openai_client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0,
                                              logit_bias={str(blue): 100})
    assert forced.choices[0].text == " blue" * 3

    plain = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=0,
                                                  logprobs=True)
    first = plain.choices[0].logprobs.content[0]
    (first_id,) = tokenizer.encode(first.token, add_special_tokens=False)
    banned = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=0,
                                                   logit_bias={str(first_id): -100})
    assert banned.choices[0].message.content and banned.choices[0].message.content != plain.choices[0].message.content


@pytest.mark.parametrize("bias", [{"blue": 5}, {"5": 101}, {"-3": 1}, {"999999": 1}])
def test_bad_logit_bias_is_400(api_server, bias) -> None:  # type: ignore[no-untyped-def]
    from e2e_helpers import assert_openai_error, chat_body, post

    response = post(api_server, "/v1/chat/completions", chat_body(logit_bias=bias), api_server.keys["inference"])
    assert_openai_error(response, 400, param="logit_bias")
