"""Streams write the events of one engine output together, and the last ones with the usage and [DONE]; a client
still reads every event, in order, as if each had been written alone."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import openai

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 12,
        "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def sdk_args(body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The same request through the SDK: what it has no parameter for goes in `extra_body`."""
    args = {**body, **changes}
    kept = {k: v for k, v in args.items() if k != "ignore_eos" and v is not None}
    return {**kept, "extra_body": {"ignore_eos": args["ignore_eos"]}}


def http_chunks(base_url: str, path: str, body: dict[str, Any], key: str) -> list[bytes]:
    """The response body's HTTP/1.1 chunks as the server wrote them: one per write of the app."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        raw = b""
        while data := sock.recv(65536):
            raw += data
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return chunks
        chunks.append(rest[:size])
        rest = rest[size + 2:]


def events(chunk: bytes) -> list[Any]:
    assert chunk.endswith(b"\n\n"), "a write ended inside an event"
    out = []
    for event in chunk.decode().split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_stream_writes_coalesced_whole_events(api_server) -> None:  # type: ignore[no-untyped-def]
    key = api_server.keys["inference"]
    writes = [events(c) for c in http_chunks(api_server.base_url, "/v1/chat/completions", {**CHAT, "n": 2}, key)]
    flat = [e for w in writes for e in w]
    # The first write: both choices' role chunks (and whatever the first output made).
    roles = [e for e in writes[0] if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert [e["choices"][0]["index"] for e in roles] == [0, 1]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in roles)
    # The last write: each choice's finish chunk, the usage chunk and [DONE], together.
    last = writes[-1]
    assert last[-1] == "[DONE]" and last[-2]["choices"] == [] and last[-2]["usage"]["completion_tokens"] == 24
    finishes = [e for e in last[:-2] if e["choices"][0]["finish_reason"] is not None]
    assert sorted(e["choices"][0]["index"] for e in finishes) == [0, 1]
    # Fewer writes than events, and every event is a whole chunk of the usual shape.
    assert len(writes) < len(flat)
    ids = {e["id"] for e in flat[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for e in flat[:-2]:
        (choice,) = e["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"} and e["object"] == "chat.completion.chunk"
        assert e["usage"] is None


class TeeTransport(httpx.BaseTransport):
    """The real HTTP transport, keeping a copy of every response body's bytes as the client reads them."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.body = bytearray()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        tee = self

        class Copied(httpx.SyncByteStream):
            def __iter__(self) -> Any:
                for data in response.stream:  # type: ignore[union-attr]
                    tee.body += data
                    yield data

            def close(self) -> None:
                response.close()

        return httpx.Response(response.status_code, headers=response.headers, stream=Copied(),
                              extensions=response.extensions)


def test_the_sdk_reads_the_same_deltas_as_the_events_written(api_server) -> None:  # type: ignore[no-untyped-def]
    tee = TeeTransport()
    client = openai.OpenAI(base_url=api_server.base_url + "/v1", api_key=api_server.keys["inference"],
                           max_retries=0, http_client=httpx.Client(transport=tee))
    seen = [chunk.model_dump() for chunk in client.chat.completions.create(**sdk_args(CHAT))]
    raw_events = [e for e in events(bytes(tee.body)) if e != "[DONE]"]
    assert len(seen) == len(raw_events) >= 3
    for parsed, event in zip(seen, raw_events, strict=True):
        assert parsed["id"] == event["id"]
        assert [{k: v for k, v in c["delta"].items() if v is not None} for c in parsed["choices"]] == [
            c["delta"] for c in event["choices"]]
        assert [c["finish_reason"] for c in parsed["choices"]] == [c["finish_reason"] for c in event["choices"]]
    assert seen[-1]["usage"]["completion_tokens"] == CHAT["max_tokens"]
    text = "".join(c["delta"].get("content") or "" for e in raw_events for c in e["choices"])
    whole = api_server.client("inference").chat.completions.create(**sdk_args(CHAT, stream=False,
                                                                               stream_options=None))
    assert text == whole.choices[0].message.content


def test_completion_stream_ends_in_one_write(api_server) -> None:  # type: ignore[no-untyped-def]
    key = api_server.keys["inference"]
    body = {"model": MODEL, "prompt": ["Once upon", "In a"], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True}
    writes = [events(c) for c in http_chunks(api_server.base_url, "/v1/completions", body, key)]
    flat = [e for w in writes for e in w]
    assert writes[-1][-1] == "[DONE]"
    finishes = [e["choices"][0]["index"] for e in flat[:-1] if e["choices"][0]["finish_reason"] is not None]
    assert sorted(finishes) == [0, 1]
    texts = {0: "", 1: ""}
    for e in flat[:-1]:
        (choice,) = e["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"} and e["object"] == "text_completion"
        texts[choice["index"]] += choice["text"]
    whole = api_server.client("inference").completions.create(**sdk_args(body, stream=False))
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == [texts[0], texts[1]]
