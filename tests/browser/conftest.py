"""Headless Chromium (Debian's package) driven by Playwright, against real uvicorn servers.

Screenshots go to `test-artifacts/browser/` (gitignored) for a human to look at.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from local_serving import free_port
from waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO_ROOT / "test-artifacts" / "browser"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORTS = {"desktop": {"width": 1280, "height": 900}, "phone": {"width": 390, "height": 844}}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.browser)



def wait_until_serving(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    def serving() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before serving {url}")
        try:
            httpx.get(url, timeout=1.0)
        except httpx.TransportError:
            return False
        return True

    wait_until(serving, timeout_s=timeout_s, interval_s=0.1, what=f"{url} to answer")


@pytest.fixture(scope="session")
def portal_only_url() -> Iterator[str]:
    """uvicorn serving just the portal router (see portal_only_app.py)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "portal_only_app:create_app",
         "--app-dir", str(Path(__file__).parent), "--port", str(port), "--log-level", "warning"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url + "/portal/signin", process, timeout_s=30)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def browser():  # type: ignore[no-untyped-def]
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium: apt-get update && apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class PageProblems:
    """Console errors, uncaught exceptions and failed responses seen by a page; a clean page has none."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def attach(self, page) -> None:  # type: ignore[no-untyped-def]
        def on_console(message) -> None:  # type: ignore[no-untyped-def]
            # the browser's own "Failed to load resource" line repeats a response recorded below
            if message.type == "error" and not message.text.startswith("Failed to load resource"):
                self.messages.append(f"console: {message.text}")

        page.on("console", on_console)
        page.on("pageerror", lambda e: self.messages.append(f"pageerror: {e}"))
        page.on("response", lambda r: r.status >= 400 and self.messages.append(
            f"HTTP {r.status} {r.request.method} {r.url}"))


@pytest.fixture
def new_page(browser):  # type: ignore[no-untyped-def]
    """new_page("desktop"|"phone") -> (page, problems); contexts closed after the test."""
    contexts = []

    def open_page(viewport: str = "desktop", **context_options):  # type: ignore[no-untyped-def]
        context = browser.new_context(viewport=VIEWPORTS[viewport], **context_options)
        context.set_default_timeout(20_000)
        contexts.append(context)
        page = context.new_page()
        problems = PageProblems()
        problems.attach(page)
        return page, problems

    yield open_page
    for context in contexts:
        context.close()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def trained_adapters(smollm_path: Path) -> dict[str, Path]:
    """Real PEFT adapters trained on SmolLM2 (cached outside the checkout, see tests/fixtures/train_adapters.py): pirate, upper, thinker."""
    from train_adapters import ensure_trained_adapters

    return ensure_trained_adapters(smollm_path)
