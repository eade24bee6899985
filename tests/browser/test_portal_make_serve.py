"""The portal as a newcomer meets it: `make serve` (a subprocess, default settings, a relative `./data`
directory, adapter validation in-process), sign in with the printed demo key, drop the two files PEFT
saved onto the upload area, watch the adapter become ready, and chat with it in the playground."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from make_serve import MakeServe, prepare_checkout
from playwright.sync_api import expect
from portal_steps import sign_in

READY_TIMEOUT_MS = 180_000

# The files of a folder dropped from a desktop file manager: real File objects in one DataTransfer.
DROP_FILES = """(files) => {
  const transfer = new DataTransfer();
  for (const [name, b64] of files) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    transfer.items.add(new File([bytes], name, { type: 'application/octet-stream' }));
  }
  const zone = document.getElementById('dropzone');
  for (const type of ['dragenter', 'dragover', 'drop']) {
    zone.dispatchEvent(new DragEvent(type, { dataTransfer: transfer, bubbles: true, cancelable: true }));
  }
}"""


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory: pytest.TempPathFactory, smollm_path: Path) -> Iterator[MakeServe]:
    server = MakeServe(prepare_checkout(tmp_path_factory.mktemp("checkout"))).start()
    try:
        yield server
    finally:
        server.stop()


def test_drop_a_peft_folder_wait_ready_and_chat_on_make_serve(
    make_serve: MakeServe, trained_adapters: dict[str, Path], new_page, artifacts_dir: Path  # type: ignore[no-untyped-def]
) -> None:
    folder = trained_adapters["pirate"]
    page, problems = new_page("desktop")
    sign_in(page, make_serve.url, make_serve.key)

    page.get_by_label("Name").fill("pirate")
    page.evaluate(DROP_FILES, [[name, base64.b64encode((folder / name).read_bytes()).decode()]
                               for name in ("adapter_config.json", "adapter_model.safetensors")])
    expect(page.locator("#file-list li")).to_have_count(2)
    page.get_by_role("button", name="Upload", exact=True).click()
    row = page.locator('tr[data-adapter="pirate"]')
    expect(row.locator(".badge")).to_have_text("Ready", timeout=READY_TIMEOUT_MS)
    expect(row).to_contain_text("k_proj, o_proj, q_proj, v_proj")
    # stored under the relative ./data of the working directory, as make serve leaves it
    assert any((make_serve.workdir / "data" / "adapters").rglob("*")), "no adapter files under ./data/adapters"
    page.screenshot(path=artifacts_dir / "make-serve-adapter-ready.png", full_page=True)

    row.get_by_role("link", name="Try").click()
    page.wait_for_url("**/portal/playground?model=pirate")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("16")
    page.get_by_label("Message").fill("What is the capital of France?")
    page.get_by_role("button", name="Send").click()
    answer = page.locator(".turn-assistant.done .turn-content")
    expect(answer).to_have_text(re.compile(r"^Arr"), timeout=300_000)  # a loaded 2-core box streams slowly

    page.screenshot(path=artifacts_dir / "make-serve-playground.png", full_page=True)
    assert problems.messages == []
