"""Sign in and the playground against the real app (uvicorn, SmolLM2 engine, SQLite)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from playwright.sync_api import expect
from portal_steps import WATCH_ANSWER, answer_snapshots, sign_in


def test_sign_in_rejects_a_revoked_key_and_signs_out(api_server, new_page) -> None:  # type: ignore[no-untyped-def]
    page, problems = new_page("desktop")
    page.goto(api_server.base_url + "/portal/signin")
    page.get_by_label("API key").fill(api_server.keys["revoked"])
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#signin-error")).to_contain_text("not accepted")
    assert page.evaluate("sessionStorage.length") == 0

    sign_in(page, api_server.base_url, api_server.keys["all"], then="/portal/playground")
    assert page.evaluate("sessionStorage.getItem('loraplex.apiKey')") == api_server.keys["all"]
    expect(page.locator("#key-hint")).to_have_text(api_server.keys["all"][:12] + "…")
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url(lambda url: urlsplit(url).path == "/portal/signin")
    assert page.evaluate("sessionStorage.length") == 0
    page.goto(api_server.base_url + "/portal/playground")
    page.wait_for_url("**/portal/signin?next=*")
    # the revoked key's 401 is the one expected console error
    assert problems.messages == [f"HTTP 401 GET {api_server.base_url}/v1/models"]


def test_playground_streams_an_answer_from_the_base_model(
    api_server, new_page, artifacts_dir: Path  # type: ignore[no-untyped-def]
) -> None:
    for viewport in ("desktop", "phone"):
        page, problems = new_page(viewport)
        sign_in(page, api_server.base_url, api_server.keys["inference"], then="/portal/playground")
        model_select = page.get_by_label("Model")
        expect(model_select).to_be_enabled()
        assert model_select.input_value() == api_server.services.base_model_name
        page.get_by_label("Temperature").fill("0")
        page.get_by_label("Max tokens").fill("24")
        page.evaluate(WATCH_ANSWER)
        page.get_by_label("Message").fill("What is the capital of France?")
        page.get_by_label("Message").press("Enter")
        expect(page.get_by_role("button", name="Stop")).to_be_visible()
        done = page.locator(".turn-assistant.done .turn-content")
        expect(done).not_to_be_empty(timeout=60_000)
        answer = done.inner_text()
        snapshots = answer_snapshots(page)
        assert len(set(snapshots)) >= 3, f"expected a streamed answer, saw {snapshots}"
        assert all(answer.startswith(s.rstrip()) for s in snapshots), "each snapshot is a prefix of the answer"
        expect(page.locator("#chat-stats")).to_contain_text("completion tokens")
        page.screenshot(path=artifacts_dir / f"playground-base-{viewport}.png", full_page=True)
        assert problems.messages == []


def test_stop_keeps_the_partial_answer_and_the_next_turn_works(api_server, new_page) -> None:  # type: ignore[no-untyped-def]
    page, problems = new_page("desktop")
    sign_in(page, api_server.base_url, api_server.keys["inference"], then="/portal/playground")
    expect(page.get_by_label("Model")).to_be_enabled()
    page.get_by_label("Max tokens").fill("1000")
    page.get_by_label("Message").fill("Write a long story about the sea.")
    page.get_by_role("button", name="Send").click()
    streaming = page.locator(".turn-assistant.streaming .turn-content")
    expect(streaming).not_to_be_empty(timeout=60_000)
    page.get_by_role("button", name="Stop").click()
    expect(page.locator("#chat-stats")).to_have_text("Stopped.")
    expect(page.get_by_role("button", name="Stop")).to_be_hidden()
    partial = page.locator(".turn-assistant.done .turn-content").first.inner_text()
    assert partial

    page.get_by_label("Max tokens").fill("8")
    page.get_by_label("Message").fill("Thanks!")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".turn-assistant.done")).to_have_count(2, timeout=60_000)
    expect(page.locator(".turn-user")).to_have_count(2)
    page.get_by_role("button", name="Clear").click()
    expect(page.locator(".turn")).to_have_count(0)
    assert problems.messages == []
