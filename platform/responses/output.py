"""Generated message parts -> Responses output items, and the typed stream events that build them.

`OutputAssembler` is fed the parser's deltas (reasoning, content, tool-call
deltas) and returns the events each one causes, in the order the SDKs expect
(item added, part added, deltas, done events). The non-streamed response is
the same assembler with its events discarded, so a streamed response and a
whole one always hold the same items.
"""

from __future__ import annotations

from typing import Any

from loraplex.platform.extensions import MessageDelta
from loraplex.platform.responses.items import new_item_id

Event = dict[str, Any]


class _OpenItem:
    def __init__(self, index: int, item: dict[str, Any]) -> None:
        self.index = index
        self.item = item
        self.text: list[str] = []


class OutputAssembler:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None
        self._calls: dict[int, _OpenItem] = {}   # by the tool-call delta's index

    def feed(self, delta: MessageDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning_content:
            events += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            events += self._call_delta(call)
        return events

    def finish(self) -> list[Event]:
        return self._close()

    # -- items ------------------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if item is None or item.item["type"] != kind:
            events += self._close()
            item = self._open_text(kind, events)
        item.text.append(text)
        delta_type = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        event = {"type": delta_type, "item_id": item.item["id"], "output_index": item.index, "content_index": 0,
                 "delta": text}
        if kind == "message":
            event["logprobs"] = []
        events.append(event)
        return events

    def _open_text(self, kind: str, events: list[Event]) -> _OpenItem:
        index = len(self.items)
        if kind == "message":
            item = {"id": new_item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open = _OpenItem(index, item)
        events += [self._added(index, item),
                   {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                    "content_index": 0, "part": part}]
        return self._open

    def _call_delta(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        key = call.get("index", 0)
        function = call.get("function") or {}
        open_call = self._calls.get(key)
        if open_call is None:
            events += self._close()
            index = len(self.items)
            item = {"id": new_item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call.get("id") or new_item_id("call"), "name": function.get("name") or "",
                    "arguments": ""}
            self.items.append(item)
            open_call = self._calls[key] = self._open = _OpenItem(index, item)
            events.append(self._added(index, item))
        elif function.get("name"):
            open_call.item["name"] += function["name"]
        arguments = function.get("arguments") or ""
        if arguments:
            open_call.text.append(arguments)
            events.append({"type": "response.function_call_arguments.delta", "item_id": open_call.item["id"],
                           "output_index": open_call.index, "delta": arguments})
        return events

    def _close(self) -> list[Event]:
        current, self._open = self._open, None
        if current is None:
            return []
        item, index, text = current.item, current.index, "".join(current.text)
        item["status"] = "completed"
        events: list[Event] = []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": text})
        else:
            if item["type"] == "message":
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                events.append({"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                               "content_index": 0, "text": text, "logprobs": []})
            else:
                part = {"type": "reasoning_text", "text": text}
                events.append({"type": "response.reasoning_text.done", "item_id": item["id"],
                               "output_index": index, "content_index": 0, "text": text})
            item["content"] = [part]
            events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": part})
        events.append({"type": "response.output_item.done", "output_index": index, "item": dict(item)})
        return events

    @staticmethod
    def _added(index: int, item: dict[str, Any]) -> Event:
        return {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
