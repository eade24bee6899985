"""The playground's multi-turn chat runs through the Responses API: each turn continues the last response."""

from __future__ import annotations

import re

from playwright.sync_api import expect
from portal_steps import sign_in


def test_second_turn_continues_the_first_response_on_the_server(api_server, new_page) -> None:  # type: ignore[no-untyped-def]
    page, problems = new_page("desktop")
    bodies: list[dict] = []
    page.on("request", lambda request: bodies.append(request.post_data_json)
            if request.url.endswith("/v1/responses") else None)
    sign_in(page, api_server.base_url, api_server.keys["inference"], then="/portal/playground")
    expect(page.get_by_label("Model")).to_be_enabled()
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("12")
    for turn, text in enumerate(["My name is Ada.", "What is my name?"], start=1):
        page.get_by_label("Message").fill(text)
        page.get_by_label("Message").press("Enter")
        expect(page.locator(".turn-assistant.done")).to_have_count(turn, timeout=60_000)
        expect(page.locator("#chat-stats")).to_contain_text("completion tokens")
    first, second = bodies
    assert first["input"] == [{"role": "user", "content": "My name is Ada."}] and "previous_response_id" not in first
    assert second["input"] == "What is my name?" and second["previous_response_id"].startswith("resp_")
    cached = re.search(r"\((\d+) cached\)", page.locator("#chat-stats").inner_text())
    assert cached and int(cached.group(1)) > 0  # the first turn's KV was still pinned
    assert problems.messages == []
