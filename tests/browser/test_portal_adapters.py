"""The adapter lifecycle in the portal, against the real app: upload (file picker with a watched
progress bar, and drag-and-drop of an archive), validation to `ready`, a streamed answer from the
adapter in the playground, failure reasons, and delete with confirmation."""

from __future__ import annotations

import base64
import io
import re
import secrets
import zipfile
from pathlib import Path

import httpx
from playwright.sync_api import expect
from portal_steps import WATCH_ANSWER, answer_snapshots, sign_in

READY_TIMEOUT_MS = 180_000  # validation includes a smoke forward pass on a shared 2-core machine

# Records every value the progress bar takes (the value attribute reflects the property).
WATCH_PROGRESS = """() => {
  window.__progress = [];
  const bar = document.getElementById('upload-bar');
  new MutationObserver(() => window.__progress.push(Number(bar.value)))
    .observe(bar, { attributes: true, attributeFilter: ['value'] });
}"""

# A drop of real File objects, as a desktop file manager would deliver them.
DROP_FILE = """([name, b64]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const transfer = new DataTransfer();
  transfer.items.add(new File([bytes], name, { type: 'application/zip' }));
  const zone = document.getElementById('dropzone');
  for (const type of ['dragenter', 'dragover', 'drop']) {
    zone.dispatchEvent(new DragEvent(type, { dataTransfer: transfer, bubbles: true, cancelable: true }));
  }
}"""


def adapters_via_api(server) -> list[dict]:  # type: ignore[no-untyped-def]
    response = httpx.get(server.base_url + "/v1/adapters", headers={"Authorization": f"Bearer {server.keys['adapters']}"})
    response.raise_for_status()
    return response.json()["data"]


def throttle_upload(page, bytes_per_second: int) -> None:  # type: ignore[no-untyped-def]
    """Slow the browser's uploads so the progress bar has something to show on localhost."""
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions", {
        "offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": bytes_per_second,
    })


def delete_with_confirmation(page, name: str, screenshot: Path | None = None) -> None:  # type: ignore[no-untyped-def]
    row = page.locator(f'tr[data-adapter="{name}"]')
    row.get_by_role("button", name=f"Delete {name}").click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text(name)
    if screenshot is not None:
        page.screenshot(path=screenshot)
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_be_hidden()
    expect(row).to_be_visible()
    row.get_by_role("button", name=f"Delete {name}").click()
    page.get_by_role("dialog").get_by_role("button", name="Delete").click()
    expect(row).to_have_count(0)


def test_upload_watch_progress_wait_ready_chat_and_delete(
    api_server, trained_adapters, new_page, artifacts_dir: Path  # type: ignore[no-untyped-def]
) -> None:
    name = f"pirate-{secrets.token_hex(3)}"
    folder = trained_adapters["pirate"]
    page, problems = new_page("desktop")
    sign_in(page, api_server.base_url, api_server.keys["all"])

    page.get_by_label("Name").fill(name)
    page.get_by_label("Description").fill("Answers like a pirate")
    page.locator("#adapter-files").set_input_files(
        [folder / "adapter_config.json", folder / "adapter_model.safetensors"])
    expect(page.locator("#file-list li")).to_have_count(2)
    page.evaluate(WATCH_PROGRESS)
    throttle_upload(page, 1_500_000)
    page.get_by_role("button", name="Upload", exact=True).click()
    expect(page.locator("#upload-status")).to_contain_text("%")
    page.wait_for_function("() => window.__progress.some((v) => v > 0 && v < 100)")
    page.screenshot(path=artifacts_dir / "adapters-uploading-desktop.png", full_page=True)
    # validation can finish before the page polls, so "ready" may come without a visible "validating"
    expect(page.locator("#upload-status")).to_contain_text(re.compile("validating|ready"), timeout=60_000)
    throttle_upload(page, -1)

    progress = page.evaluate("window.__progress")
    assert progress == sorted(progress), f"progress went backwards: {progress}"
    assert progress[-1] == 100
    assert len([v for v in progress if 0 < v < 100]) >= 2, f"expected intermediate progress, saw {progress}"

    row = page.locator(f'tr[data-adapter="{name}"]')
    expect(row).to_be_visible()
    expect(row.locator(".badge")).to_have_text("Ready", timeout=READY_TIMEOUT_MS)
    expect(page.locator("#list-status")).to_have_text("")  # polling stopped
    expect(page.locator("#upload-status")).to_have_text(f"“{name}” is ready to use.")
    expect(row).to_contain_text("8 / 16")
    expect(row).to_contain_text("k_proj, o_proj, q_proj, v_proj")
    page.screenshot(path=artifacts_dir / "adapters-ready-desktop.png", full_page=True)

    row.get_by_role("link", name="Try").click()
    page.wait_for_url(f"**/portal/playground?model={name}")
    expect(page.get_by_label("Model")).to_have_value(name)
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("24")
    page.evaluate(WATCH_ANSWER)
    page.get_by_label("Message").fill("What is the capital of France?")
    page.get_by_role("button", name="Send").click()
    answer = page.locator(".turn-assistant.done .turn-content")
    expect(answer).to_have_text(re.compile(r"^Arr"), timeout=60_000)
    snapshots = set(answer_snapshots(page))
    assert len(snapshots) >= 3, f"expected a streamed answer, saw {snapshots}"
    page.screenshot(path=artifacts_dir / "playground-adapter-desktop.png", full_page=True)

    page.get_by_role("link", name="Adapters").click()
    delete_with_confirmation(page, name, screenshot=artifacts_dir / "adapters-delete-dialog-desktop.png")
    assert name not in {a["name"] for a in adapters_via_api(api_server)}
    assert problems.messages == []


def test_cancel_an_upload_midway(api_server, trained_adapters, new_page) -> None:  # type: ignore[no-untyped-def]
    name = f"cancelled-{secrets.token_hex(3)}"
    folder = trained_adapters["upper"]
    page, problems = new_page("desktop")
    sign_in(page, api_server.base_url, api_server.keys["all"])
    page.get_by_label("Name").fill(name)
    page.locator("#adapter-files").set_input_files(
        [folder / "adapter_config.json", folder / "adapter_model.safetensors"])
    page.evaluate(WATCH_PROGRESS)
    throttle_upload(page, 500_000)
    page.get_by_role("button", name="Upload", exact=True).click()
    page.wait_for_function("() => window.__progress.some((v) => v > 0)")
    page.get_by_role("button", name="Cancel upload").click()
    expect(page.locator("#upload-error")).to_have_text("Upload cancelled.")
    expect(page.locator("#upload-progress")).to_be_hidden()
    expect(page.get_by_role("button", name="Upload", exact=True)).to_be_enabled()
    assert name not in {a["name"] for a in adapters_via_api(api_server)}
    assert problems.messages == []


def test_drop_an_archive_at_phone_width(
    api_server, trained_adapters, new_page, artifacts_dir: Path  # type: ignore[no-untyped-def]
) -> None:
    name = f"upper-{secrets.token_hex(3)}"
    folder = trained_adapters["upper"]
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            zf.write(folder / file, file)
    page, problems = new_page("phone")
    sign_in(page, api_server.base_url, api_server.keys["all"])

    page.evaluate(DROP_FILE, [f"{name}.zip", base64.b64encode(archive.getvalue()).decode()])
    expect(page.locator("#file-list li")).to_have_count(1)
    expect(page.get_by_label("Name")).to_have_value(name)  # taken from the archive's name
    page.get_by_role("button", name="Upload", exact=True).click()
    row = page.locator(f'tr[data-adapter="{name}"]')
    # A small adapter may validate before the list first renders it: "Validating" is not always seen.
    expect(row.locator(".badge")).to_have_text(re.compile(r"^\s*(Validating|Ready)\s*$"))
    expect(row.locator(".badge")).to_have_text("Ready", timeout=READY_TIMEOUT_MS)
    page.screenshot(path=artifacts_dir / "adapters-ready-phone.png", full_page=True)
    delete_with_confirmation(page, name, screenshot=artifacts_dir / "adapters-delete-dialog-phone.png")
    assert problems.messages == []


def test_failed_validation_shows_the_reason(
    api_server, tmp_path: Path, new_page, artifacts_dir: Path  # type: ignore[no-untyped-def]
) -> None:
    from random_adapters import tiny_spec, write_random_adapter

    folder = write_random_adapter(tmp_path / "tiny", tiny_spec())  # shaped for a 64-wide model, not SmolLM2
    name = f"wrong-base-{secrets.token_hex(3)}"
    page, problems = new_page("desktop")
    sign_in(page, api_server.base_url, api_server.keys["all"])

    page.locator("#adapter-files").set_input_files([folder / "adapter_model.safetensors"])
    page.get_by_label("Name").fill(name)
    page.get_by_role("button", name="Upload", exact=True).click()
    expect(page.locator("#upload-error")).to_contain_text("adapter_config.json")  # refused before sending

    page.locator("#adapter-files").set_input_files(
        [folder / "adapter_config.json", folder / "adapter_model.safetensors"])
    page.get_by_role("button", name="Upload", exact=True).click()
    row = page.locator(f'tr[data-adapter="{name}"]')
    expect(row.locator(".badge")).to_have_text("Failed", timeout=READY_TIMEOUT_MS)
    expect(page.locator("#upload-status")).to_contain_text("failed validation")
    reason = next(a["reason"] for a in adapters_via_api(api_server) if a["name"] == name)
    assert reason
    expect(row.locator(".failure-reason")).to_have_text(reason)
    page.screenshot(path=artifacts_dir / "adapters-failed-desktop.png", full_page=True)

    # a second upload under the same name is refused by the API, and the message shown
    page.locator("#adapter-files").set_input_files(
        [folder / "adapter_config.json", folder / "adapter_model.safetensors"])
    page.get_by_label("Name").fill(name)
    page.get_by_role("button", name="Upload", exact=True).click()
    expect(page.locator("#upload-error")).to_contain_text(name)
    delete_with_confirmation(page, name)
    assert [m for m in problems.messages if "409" not in m] == []
