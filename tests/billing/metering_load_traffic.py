"""The traffic of the metering load test: a mix of request kinds sent through the `openai` client.

Each `Kind` says how one kind of request is built (endpoint, model, streaming,
`n`, extra fields); `send` runs one request of a kind and returns what the
client saw: the request id, the usage the server returned (None when the
client dropped the stream) and what the test needs to check its ledger row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["cats", "rain", "the moon", "bread", "rivers", "music", "snow", "trains", "apples", "clocks"]
# The prompts the adapters were trained on: the pirate says "Arr" and the thinker thinks on these.
TRAINED_PROMPTS = ["What is the capital of France?", "Name a colour.", "How are you today?",
                   "What is two plus two?", "Tell me about the sea.", "What do cats eat?"]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
THINKING_BUDGETS = [0, 2, 5, 8]
DROP_AFTER_CHUNKS = 2
# A dropped stream ignores EOS and may run far past the drop, so it cannot finish on the server before
# the client has gone; the tokens it makes until the abort lands are billed and checked like the rest.
DROP_MAX_TOKENS = 48


@dataclass(frozen=True)
class Kind:
    name: str
    count: int
    api: str = "chat"                 # chat | completions
    model: str = MODEL                # or an adapter's name
    stream: bool = False
    drop: bool = False                # the client closes the stream after DROP_AFTER_CHUNKS chunks
    n: int = 1
    max_tokens: tuple[int, int] = (2, 12)
    session: str | None = None        # "lane": the lane's own session; "own": a fresh one per request
    budget: bool = False              # extra_body max_reasoning_tokens from THINKING_BUDGETS
    tools: bool = False
    stop: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # more body fields


# Each kind is sent several times from the test's 12 concurrent lanes, so each one meets the others under load;
# more of each would add CPU time (the suite is CPU-bound), not cases.
MIX = [
    Kind("plain", 16),
    Kind("stream", 12, stream=True, max_tokens=(8, 24)),
    Kind("n2", 6, n=2, max_tokens=(3, 8)),
    Kind("n2_stream", 6, n=2, stream=True, max_tokens=(3, 8)),
    Kind("stop", 8, stop=True, max_tokens=(16, 16)),
    Kind("session", 14, session="lane", max_tokens=(6, 6)),
    Kind("pirate", 6, model="pirate", max_tokens=(4, 16)),
    Kind("pirate_stream", 4, model="pirate", stream=True, max_tokens=(4, 16)),
    Kind("thinker", 6, model="thinker", max_tokens=(12, 24)),
    Kind("thinker_stream", 4, model="thinker", stream=True, max_tokens=(12, 24)),
    Kind("thinker_budget", 7, model="thinker", budget=True, max_tokens=(16, 24)),
    # A forced tool call takes ~30 tokens; with parallel calls allowed the model keeps calling until max_tokens.
    Kind("tools", 3, tools=True, max_tokens=(24, 24)),
    # Room past the call: near the budget the grammar steers to close it, and such a close finishes `length`.
    Kind("tools_single", 3, tools=True, max_tokens=(56, 56), extra={"parallel_tool_calls": False}),
    Kind("thinker_tools", 2, model="thinker", tools=True, budget=True, max_tokens=(40, 40),
         extra={"parallel_tool_calls": False}),
    Kind("completion", 7, api="completions", max_tokens=(2, 16)),
    Kind("completion_stream", 4, api="completions", stream=True, max_tokens=(2, 16)),
    # The dropped streams: 12 of the 120 requests, spread over the kinds that stream.
    Kind("drop_stream", 4, stream=True, drop=True),
    Kind("drop_n2", 2, n=2, stream=True, drop=True),
    Kind("drop_thinker", 2, model="thinker", stream=True, drop=True),
    Kind("drop_pirate", 1, model="pirate", stream=True, drop=True),
    Kind("drop_completion", 2, api="completions", stream=True, drop=True),
    Kind("drop_session", 1, stream=True, drop=True, session="own"),
]


@dataclass
class Sent:
    kind: Kind
    request_id: str
    usage: dict | None                       # None: the client went away before the end
    max_output_tokens: int                   # max_tokens x n: the most the engine may make
    session_id: str | None = None
    budget: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    text: str = ""                           # choice 0's content (or text), as the client got it
    num_tool_calls: int = 0
    num_text_chunks: int = 0                 # chunks that carried output text: each is >= 1 token
    num_reasoning_chunks: int = 0            # chunks that carried reasoning text: each is >= 1 thinking token


def shuffled_kinds(seed: int) -> list[Kind]:
    kinds = [kind for kind in MIX for _ in range(kind.count)]
    random.Random(seed).shuffle(kinds)
    return kinds


def send(client: Any, kind: Kind, rng: random.Random, session_id: str | None) -> Sent:
    max_tokens = DROP_MAX_TOKENS if kind.drop else rng.randint(*kind.max_tokens)
    body: dict[str, Any] = {"model": kind.model, "temperature": 0, "max_tokens": max_tokens, "n": kind.n,
                            **kind.extra}
    extra_body: dict[str, Any] = {"ignore_eos": kind.drop}
    budget = rng.choice(THINKING_BUDGETS) if kind.budget else None
    if budget is not None:
        extra_body["max_reasoning_tokens"] = budget
    if session_id is not None:
        extra_body["session_id"] = session_id
    ask = rng.choice(TRAINED_PROMPTS) if kind.model != MODEL else f"Write about {rng.choice(TOPICS)} in one line."
    if kind.tools:
        body |= {"tools": [WEATHER_TOOL], "tool_choice": "required"}
        ask = "What's the weather in Paris?"
    if kind.stop:
        body["stop"] = [".", "\n"]
    if kind.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if kind.api == "chat":
        raw = client.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": ask}], extra_body=extra_body, **body)
    else:
        raw = client.completions.with_raw_response.create(prompt=ask, extra_body=extra_body, **body)
    sent = Sent(kind, raw.headers["x-request-id"], None, max_tokens * kind.n, session_id, budget)
    if kind.stream:
        _read_stream(raw.parse(), sent)
    else:
        _read_whole(raw.parse(), sent)
    return sent


def _read_whole(answer: Any, sent: Sent) -> None:
    sent.usage = answer.usage.model_dump()
    sent.finish_reasons = [choice.finish_reason for choice in answer.choices]
    first = answer.choices[0]
    if sent.kind.api == "completions":
        sent.text = first.text
        return
    sent.text = first.message.content or ""
    sent.num_tool_calls = len(first.message.tool_calls or [])


def _read_stream(stream: Any, sent: Sent) -> None:
    usage = None
    for index, chunk in enumerate(stream):
        if sent.kind.drop and index == DROP_AFTER_CHUNKS:
            stream.close()  # the client goes away mid-way
            return
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text = choice.text if sent.kind.api == "completions" else choice.delta.content
            reasoning = None if sent.kind.api == "completions" else (choice.delta.model_extra or {}).get(
                "reasoning_content")
            sent.num_text_chunks += bool(text) or bool(reasoning)
            sent.num_reasoning_chunks += bool(reasoning)
            if choice.index == 0:
                sent.text += text or ""
            if choice.finish_reason is not None:
                sent.finish_reasons.append(choice.finish_reason)
    sent.usage = usage
