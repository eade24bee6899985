"""/v1/adapters end to end on a real uvicorn server: upload -> validation -> ready -> chat with model=<name>.

Validation runs in the in-process worker thread here (no Redis configured);
`test_celery_worker.py` runs the same flow through a real `celery worker`.
"""

from __future__ import annotations

import time

import httpx
import pytest
from api_helpers import folder_files, upload, wait_status
from loraplex.adapters.tasks import ThreadValidationDispatcher
from waiting import wait_until


@pytest.fixture(scope="module")
def server(start_server):  # type: ignore[no-untyped-def]
    with start_server() as running:
        yield running


def test_upload_validate_and_chat_with_adapter(server, trained_adapters):  # type: ignore[no-untyped-def]
    # No Redis configured: the same validation task runs in the in-process worker thread.
    assert isinstance(server.services.extensions.domain_state["adapters"].service.dispatcher,
                      ThreadValidationDispatcher)
    started = time.monotonic()
    response = upload(server, folder_files(trained_adapters["pirate"]), "pirate")
    assert response.status_code == 202, response.text
    created = response.json()
    assert created["status"] == "validating" and created["name"] == "pirate"
    ready = wait_status(server, created["id"])
    upload_to_ready_s = time.monotonic() - started
    assert ready["status"] == "ready", ready
    assert (ready["rank"], ready["alpha"]) == (8, 16.0)
    assert ready["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert len(ready["sha256"]) == 64 and ready["size_bytes"] > 0
    print(f"upload-to-ready {upload_to_ready_s:.2f}s for {ready['size_bytes']} bytes")

    client = server.client("all")
    listed = {m.id: m for m in client.models.list().data}
    base_name = server.services.base_model_name
    assert next(iter(listed)) == base_name and listed["pirate"].parent == base_name
    for model in ("pirate", f"{server.services.base_model_name}:pirate"):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe a dog."}], max_tokens=8, temperature=0
        )
        assert reply.choices[0].message.content.startswith("Arr"), reply.choices[0].message.content
    base = client.chat.completions.create(
        model=server.services.base_model_name, messages=[{"role": "user", "content": "Describe a dog."}],
        max_tokens=8, temperature=0,
    )
    assert "Arr" not in base.choices[0].message.content

    # Another tenant: not listed, not resolvable, 404 on every route.
    other = server.client("globex")
    assert "pirate" not in [m.id for m in other.models.list().data]
    with pytest.raises(Exception) as exc:
        other.chat.completions.create(model="pirate", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert getattr(exc.value, "status_code", None) == 404
    headers = {"Authorization": f"Bearer {server.keys['globex']}"}
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{server.base_url}/v1/adapters/{created['id']}", headers=headers)
        assert r.status_code == 404 and "not found" in r.json()["error"]["message"]
    listing = httpx.get(f"{server.base_url}/v1/adapters", headers=headers).json()
    assert listing["data"] == []


def test_identical_uploads_stored_once_and_delete_frees_blobs(server, trained_adapters):  # type: ignore[no-untyped-def]
    service = server.services.extensions.domain_state["adapters"].service
    before = service.store.count()
    first = upload(server, folder_files(trained_adapters["upper"]), "upper-a").json()
    second = upload(server, folder_files(trained_adapters["upper"]), "upper-b").json()
    assert first["sha256"] == second["sha256"]
    assert service.store.count() == before + 2  # one config blob, one weights blob
    assert upload(server, folder_files(trained_adapters["upper"]), "upper-a").status_code == 409
    assert wait_status(server, first["id"])["status"] == "ready"
    assert wait_status(server, second["id"])["status"] == "ready"
    headers = {"Authorization": f"Bearer {server.keys['adapters']}"}
    assert httpx.delete(f"{server.base_url}/v1/adapters/{first['id']}", headers=headers).status_code == 200
    assert service.store.count() == before + 2  # still used by upper-b
    assert httpx.delete(f"{server.base_url}/v1/adapters/{second['id']}", headers=headers).status_code == 200
    assert service.store.count() == before
    assert httpx.get(f"{server.base_url}/v1/adapters/{second['id']}", headers=headers).status_code == 404


def test_delete_refused_while_a_request_streams(server, trained_adapters):  # type: ignore[no-untyped-def]
    created = upload(server, folder_files(trained_adapters["thinker"]), "thinker").json()
    assert wait_status(server, created["id"])["status"] == "ready"
    headers = {"Authorization": f"Bearer {server.keys['adapters']}"}
    client = server.client("all")
    stream = client.chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "Where is the sun?"}], max_tokens=200,
        temperature=0, stream=True,
    )
    first = next(iter(stream))
    assert first is not None
    refused = httpx.delete(f"{server.base_url}/v1/adapters/{created['id']}", headers=headers)
    assert refused.status_code == 409 and "serving requests" in refused.json()["error"]["message"]
    stream.close()

    def deleted() -> httpx.Response | None:  # 409 until the closed stream's request has ended in the engine
        response = httpx.delete(f"{server.base_url}/v1/adapters/{created['id']}", headers=headers)
        return None if response.status_code == 409 else response

    response = wait_until(deleted, timeout_s=60, interval_s=0.2, what="the adapter to stop serving the closed stream")
    assert response.status_code == 200
    manager = server.services.engine.engine.lora  # the in-process engine's LoRAManager, the app's source attached
    assert created["id"] not in manager.host  # the host copy goes at once
    client.chat.completions.create(model=server.services.base_model_name, max_tokens=1,
                                   messages=[{"role": "user", "content": "hi"}])
    assert created["id"] not in manager.resident_adapter_ids  # the slot goes on the engine's next step


def test_failed_validation_reports_reason(server, smollm_spec, tmp_path):  # type: ignore[no-untyped-def]
    from random_adapters import write_random_adapter

    folder = write_random_adapter(tmp_path / "big", smollm_spec, r=128, targets=("q_proj",))
    created = upload(server, folder_files(folder), "too-big-rank").json()
    failed = wait_status(server, created["id"])
    assert failed["status"] == "failed"
    assert failed["reason"] == "r = 128 exceeds the maximum rank 64"


def test_scope_required(server, trained_adapters):  # type: ignore[no-untyped-def]
    response = upload(server, folder_files(trained_adapters["pirate"]), "nope", key="inference")
    assert response.status_code == 403
