"""Property: whatever numbers and shapes one tenant sends, no request gets a 5xx, every refusal is a 4xx naming
the field, and another tenant's greedy request running in the same batches is unchanged.

Hypothesis draws bodies for chat completions, completions and responses with extreme, boundary and malformed
values (past int64, NaN and infinities, negative counts, wrong types) in every numeric and list field, a few at a
time, while a victim tenant's long greedy stream runs through the same engine.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct"
VICTIM_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Count slowly from one to fifty."}],
               "max_tokens": 48, "temperature": 0, "ignore_eos": True}

EXTREME_INTS = [2**63, 2**63 - 1, 2**64, -(2**63) - 1, -(2**63), 2**31, -1, -(2**31), 0, 10**30]
EXTREME_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 3.0, -3.0, 101.0]
MALFORMED = [None, True, "1", "NaN", [], {}, [1], {"a": 1}]

extreme = st.one_of(st.sampled_from(EXTREME_INTS), st.sampled_from(EXTREME_FLOATS), st.sampled_from(MALFORMED),
                    st.integers(), st.floats(allow_nan=True, allow_infinity=True))
token_ids = st.lists(st.sampled_from([-1, 0, 49151, 49152, 2**31, 2**63, 2**64, "x", 1.5]), max_size=4)

SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "n", "min_tokens", "priority"]
CHAT_FIELDS = [*SAMPLING_FIELDS, "max_tokens", "max_completion_tokens", "top_logprobs", "max_reasoning_tokens"]
COMPLETION_FIELDS = [*SAMPLING_FIELDS, "max_tokens", "logprobs", "best_of"]
RESPONSES_FIELDS = ["temperature", "top_p", "max_output_tokens", "top_logprobs"]


def mutations(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    one = st.one_of(
        st.tuples(st.sampled_from(fields), extreme),
        st.tuples(st.just("stop_token_ids"), token_ids),
        st.tuples(st.just("logit_bias"), st.dictionaries(
            st.sampled_from(["0", "49151", "49152", "-1", "99999999999999999999", "x"]),
            st.sampled_from([0.0, 100.0, 101.0, -101.0, math.nan, math.inf, 2**64]), max_size=3)),
    )
    return st.lists(one, min_size=1, max_size=3).map(dict)


@pytest.fixture(scope="module")
def victim(api_server) -> dict[str, Any]:
    """The victim's quiet output, and a way to run it in the background."""
    with httpx.Client(timeout=120) as client:
        quiet = client.post(api_server.base_url + "/v1/chat/completions", json=VICTIM_BODY,
                            headers={"Authorization": f"Bearer {api_server.keys['globex']}"}).json()
    return {"text": quiet["choices"][0]["message"]["content"]}


class Background:
    """The victim's request on a loop in its own thread while the examples run."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.stop = threading.Event()
        self.results: list[tuple[int, str]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                reply = client.post(self.server.base_url + "/v1/chat/completions", json=VICTIM_BODY,
                                    headers={"Authorization": f"Bearer {self.server.keys['globex']}"})
                body = reply.json()
                text = body["choices"][0]["message"]["content"] if reply.status_code == 200 else reply.text
                self.results.append((reply.status_code, text))

    def __enter__(self) -> Background:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def check_reply(reply: httpx.Response, fields: dict[str, Any]) -> None:
    assert reply.status_code < 500, (fields, reply.status_code, reply.text[:500])
    if reply.status_code >= 400:
        error = reply.json()["error"]
        named = f"{error.get('param') or ''} {error.get('message') or ''}"
        assert any(field in named for field in fields) or reply.status_code in (401, 429), (fields, error)


def send(client: httpx.Client, server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    """JSON as Python writes it, NaN and Infinity included (httpx's own encoder refuses them; clients send them)."""
    return client.post(server.base_url + path, content=json.dumps(body),
                       headers={"Authorization": f"Bearer {server.keys['all']}", "Content-Type": "application/json"})


PROPERTY_SETTINGS = settings(max_examples=30, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_poisoned_chat_completions_and_responses_never_hurt_the_other_tenant(api_server, victim) -> None:
    with Background(api_server) as background, httpx.Client(timeout=120) as client:

        @PROPERTY_SETTINGS
        @given(chat=mutations(CHAT_FIELDS), completion=mutations(COMPLETION_FIELDS),
               responses=mutations(RESPONSES_FIELDS))
        def property_holds(chat: dict, completion: dict, responses: dict) -> None:
            base = {"model": MODEL, "max_tokens": 4}
            chat_body = {**base, "messages": [{"role": "user", "content": "Hi"}], **chat}
            check_reply(send(client, api_server, "/v1/chat/completions", chat_body), chat)
            completion_body = {**base, "prompt": "Hello", **completion}
            check_reply(send(client, api_server, "/v1/completions", completion_body), completion)
            responses_body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **responses}
            check_reply(send(client, api_server, "/v1/responses", responses_body), responses)

        property_holds()
    assert background.results, "the victim's request never completed"
    for status, text in background.results:
        assert status == 200 and text == victim["text"]


# Half of a UTF-16 surrogate pair, escaped: valid JSON syntax, but not Unicode text. Python's parser would hand the
# tokenizer (and PostgreSQL, Redis, the grammar compiler) a string none of them can encode.
LONE_SURROGATE = "\\ud800"
SURROGATE_BODIES = {
    "chat message": ("/v1/chat/completions",
                     '{"model": "%s", "messages": [{"role": "user", "content": "hi %s"}], "max_tokens": 2}'),
    "chat user": ("/v1/chat/completions",
                  '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "user": "%s", "max_tokens": 2}'),
    "chat stop": ("/v1/chat/completions",
                  '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stop": ["%s"], "max_tokens": 2}'),
    "schema key": ("/v1/chat/completions",
                   '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": '
                   '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": '
                   '{"a%s": {"type": "string"}}}}}}'),
    "completion prompt": ("/v1/completions", '{"model": "%s", "prompt": "%s", "max_tokens": 2}'),
    "responses input": ("/v1/responses", '{"model": "%s", "input": "x%s", "max_output_tokens": 2}'),
}


@pytest.mark.parametrize("case", sorted(SURROGATE_BODIES))
def test_a_lone_surrogate_anywhere_in_a_body_is_a_400(api_server, case: str) -> None:
    path, template = SURROGATE_BODIES[case]
    with httpx.Client(timeout=120) as client:
        reply = client.post(api_server.base_url + path, content=template % (MODEL, LONE_SURROGATE),
                            headers={"Authorization": f"Bearer {api_server.keys['all']}",
                                     "Content-Type": "application/json"})
        assert reply.status_code == 400, reply.text
        assert "lone UTF-16 surrogate" in reply.json()["error"]["message"]
        # A whole pair, escaped (how Python's json.dumps writes an emoji), is text and is served.
        paired = client.post(api_server.base_url + path, content=template % (MODEL, "\\ud83d\\ude00"),
                             headers={"Authorization": f"Bearer {api_server.keys['all']}",
                                      "Content-Type": "application/json"})
        assert paired.status_code == 200, paired.text


@pytest.mark.parametrize(("path", "raw", "reason"), [
    # small enough for the normal parser, large enough for the edge's count probe (64 KiB and up)
    ("/v1/chat/completions", '{"model": "%s", "metadata": ' + "[" * 2000 + "]" * 2000 + "}",
     "nest deeper than the parser allows"),
    ("/v1/chat/completions", '{"model": "%s", "metadata": ' + "[" * 50_000 + "]" * 50_000 + "}",
     "nest deeper than the parser allows"),
    ("/v1/responses", '{"model": "%s", "input": "hi", "metadata": ' + '{"a":' * 2000 + "1" + "}" * 2000 + "}",
     "nest deeper than the parser allows"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "seed": '
     + "1" * 5000 + "}", "a number is too long to read"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
     '"structured_outputs": {"json": "' + "[" * 5000 + "]" * 5000 + '"}}', "neither a JSON schema object"),
])
def test_json_the_parser_cannot_take_is_a_400_that_says_why(api_server, path: str, raw: str, reason: str) -> None:
    """Nesting past the parser's recursion and integers past Python's digit limit raised RecursionError and
    ValueError, which came back as a 500 (and a dropped keep-alive connection) or a bare "error parsing the
    body"; the server serves the next request on the same connection."""
    headers = {"Authorization": f"Bearer {api_server.keys['all']}", "Content-Type": "application/json"}
    with httpx.Client(timeout=120) as client:
        reply = client.post(api_server.base_url + path, content=raw % MODEL, headers=headers)
        assert reply.status_code == 400, reply.text
        assert reason in reply.json()["error"]["message"]
        after = client.post(api_server.base_url + "/v1/chat/completions", headers=headers, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert after.status_code == 200, after.text


def test_a_json_body_sent_as_a_form_is_told_to_send_json(api_server) -> None:
    """`curl -d '{...}'` without a content type sends a form: the 400 says what to change."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    reply = httpx.post(api_server.base_url + "/v1/chat/completions", content=body, timeout=60,
                       headers={"Authorization": f"Bearer {api_server.keys['all']}",
                                "Content-Type": "application/x-www-form-urlencoded"})
    assert reply.status_code == 400
    assert "Content-Type: application/json" in reply.json()["error"]["message"]
