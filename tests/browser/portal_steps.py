"""Steps the browser tests share: signing in, and watching an answer stream."""

from __future__ import annotations

from urllib.parse import quote, urlsplit

# Records every text the answer bubble shows while it streams, so a test can
# tell a token-by-token stream from one answer arriving at once.
WATCH_ANSWER = """() => {
  window.__answerSnapshots = [];
  new MutationObserver(() => {
    const bubble = document.querySelector('.turn-assistant .turn-content');
    if (bubble) window.__answerSnapshots.push(bubble.textContent);
  }).observe(document.getElementById('transcript'), { subtree: true, childList: true, characterData: true });
}"""


def sign_in(page, base_url: str, key: str, *, then: str = "/portal/adapters") -> None:  # type: ignore[no-untyped-def]
    """Paste the key on the sign-in page and wait until the portal lands on `then`."""
    page.goto(f"{base_url}/portal/signin?next={quote(then)}")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda url: urlsplit(url).path == urlsplit(then).path)


def answer_snapshots(page) -> list[str]:  # type: ignore[no-untyped-def]
    return [s for s in page.evaluate("window.__answerSnapshots") if s]
