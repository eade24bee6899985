"""API keys against a real server: missing, wrong, revoked, scopes, revocation on the next request."""

from __future__ import annotations

import hashlib

import httpx
from e2e_helpers import MODEL, assert_openai_error, auth, chat_body, post
from sqlalchemy import create_engine, text


def test_no_key_is_401(api_server) -> None:  # type: ignore[no-untyped-def]
    response = post(api_server, "/v1/chat/completions", chat_body(), key=None)
    error = assert_openai_error(response, 401, code="missing_api_key")
    assert error["type"] == "authentication_error"
    assert response.headers["www-authenticate"] == "Bearer"


def test_wrong_key_is_401(api_server) -> None:  # type: ignore[no-untyped-def]
    wrong = api_server.keys["inference"][:-4] + "abcd"
    assert_openai_error(post(api_server, "/v1/chat/completions", chat_body(), key=wrong), 401, code="invalid_api_key")
    malformed = httpx.get(api_server.base_url + "/v1/models", headers={"Authorization": "Basic abc"})
    assert_openai_error(malformed, 401, code="invalid_api_key")


def test_revoked_key_is_401(api_server) -> None:  # type: ignore[no-untyped-def]
    response = post(api_server, "/v1/chat/completions", chat_body(), key=api_server.keys["revoked"])
    assert_openai_error(response, 401, code="invalid_api_key")


def test_missing_scope_is_403(api_server) -> None:  # type: ignore[no-untyped-def]
    error = assert_openai_error(
        post(api_server, "/v1/chat/completions", chat_body(), key=api_server.keys["usage"]), 403, code="insufficient_scope"
    )
    assert "inference" in error["message"]
    admin_only = httpx.get(api_server.base_url + "/v1/admin/tenants", headers=auth(api_server.keys["inference"]))
    assert_openai_error(admin_only, 403, code="insufficient_scope")


def test_revocation_takes_effect_on_the_next_request(api_server) -> None:  # type: ignore[no-untyped-def]
    admin = auth(api_server.keys["admin"])
    base = api_server.base_url
    created = httpx.post(f"{base}/v1/admin/tenants/acme/keys", json={"name": "temp", "scopes": ["inference"]}, headers=admin)
    assert created.status_code == 201, created.text
    key, key_id = created.json()["key"], created.json()["id"]
    assert key.startswith("lpx_") and len(key) >= 4 + 43  # 256 random bits, base64url
    assert httpx.get(f"{base}/v1/models", headers=auth(key)).status_code == 200

    revoked = httpx.delete(f"{base}/v1/admin/keys/{key_id}", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert_openai_error(httpx.get(f"{base}/v1/models", headers=auth(key)), 401)


def test_keys_are_listed_without_secrets_and_track_last_use(api_server) -> None:  # type: ignore[no-untyped-def]
    admin = auth(api_server.keys["admin"])
    base = api_server.base_url
    created = httpx.post(f"{base}/v1/admin/tenants/globex/keys", json={"scopes": ["inference"]}, headers=admin).json()

    def listed() -> dict:
        keys = httpx.get(f"{base}/v1/admin/tenants/globex/keys", headers=admin).json()["data"]
        return next(k for k in keys if k["id"] == created["id"])

    before = listed()
    assert "key" not in before and before["key_prefix"] == created["key"][:12]
    assert before["last_used_at"] is None
    assert httpx.get(f"{base}/v1/models", headers=auth(created["key"])).status_code == 200
    assert listed()["last_used_at"] is not None


def test_only_the_hash_is_stored(api_server) -> None:  # type: ignore[no-untyped-def]
    engine = create_engine(api_server.settings.resolved_database_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM api_keys")).fetchall()
    engine.dispose()
    dump = repr(rows)
    for key in api_server.keys.values():
        assert key not in dump
        assert hashlib.sha256(key.encode()).hexdigest() in dump


def test_admin_creates_tenants_and_rejects_duplicates(api_server) -> None:  # type: ignore[no-untyped-def]
    admin = auth(api_server.keys["admin"])
    base = api_server.base_url
    assert httpx.post(f"{base}/v1/admin/tenants", json={"name": "initech"}, headers=admin).status_code == 201
    assert_openai_error(httpx.post(f"{base}/v1/admin/tenants", json={"name": "initech"}, headers=admin), 409)
    names = [t["name"] for t in httpx.get(f"{base}/v1/admin/tenants", headers=admin).json()["data"]]
    assert {"acme", "globex", "initech"} <= set(names)
    bad_scope = httpx.post(f"{base}/v1/admin/tenants/initech/keys", json={"scopes": ["root"]}, headers=admin)
    assert_openai_error(bad_scope, 400, param="scopes")
    for body, param in (({"scopes": [1]}, "scopes"), ({"rpm_limit": 3_000_000_000}, "rpm_limit"),
                        ({"tpm_limit": 10**20}, "tpm_limit")):  # each was a 500
        assert_openai_error(httpx.post(f"{base}/v1/admin/tenants/initech/keys", json=body, headers=admin), 400,
                            param=param)
    # A field the key does not have is refused by name: an operator asking for an expiry must not get a key
    # that never expires.
    expiring = httpx.post(f"{base}/v1/admin/tenants/initech/keys", json={"expires_at": "2027-01-01"}, headers=admin)
    assert_openai_error(expiring, 400, param="expires_at")
    assert_openai_error(httpx.post(f"{base}/v1/admin/tenants", json={"name": "x", "wieght": 2}, headers=admin), 400,
                        param="wieght")
    assert_openai_error(httpx.post(f"{base}/v1/admin/tenants/nope/keys", json={}, headers=admin), 404)


def test_models_route_needs_a_key(api_server) -> None:  # type: ignore[no-untyped-def]
    assert_openai_error(httpx.get(api_server.base_url + "/v1/models"), 401)
    ok = httpx.get(api_server.base_url + "/v1/models", headers=auth(api_server.keys["globex"]))
    assert [m["id"] for m in ok.json()["data"]] == [MODEL]


def test_another_tenants_resources_are_404(api_server) -> None:  # type: ignore[no-untyped-def]
    """A session belongs to acme; globex gets the same 404 as for an id that never existed."""
    base = api_server.base_url
    acme, globex = auth(api_server.keys["all"]), auth(api_server.keys["globex"])
    created = httpx.post(f"{base}/v1/sessions", json={"model": MODEL}, headers=acme)
    assert created.status_code == 200, created.text
    session_id = created.json()["id"]
    assert httpx.get(f"{base}/v1/sessions/{session_id}", headers=acme).status_code == 200

    theirs = httpx.get(f"{base}/v1/sessions/{session_id}", headers=globex)
    missing = httpx.get(f"{base}/v1/sessions/{session_id[:-4]}zzzz", headers=globex)
    assert_openai_error(theirs, 404)
    assert_openai_error(missing, 404)
    assert theirs.json()["error"]["message"].replace(session_id, "X") == missing.json()["error"]["message"].replace(
        session_id[:-4] + "zzzz", "X"
    )
    assert session_id not in [s["id"] for s in httpx.get(f"{base}/v1/sessions", headers=globex).json()["data"]]
    assert_openai_error(httpx.delete(f"{base}/v1/sessions/{session_id}", headers=globex), 404)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "session_id": session_id}
    assert_openai_error(httpx.post(f"{base}/v1/chat/completions", json=chat, headers=globex, timeout=60), 404)
    assert httpx.get(f"{base}/v1/sessions/{session_id}", headers=acme).status_code == 200
