"""The billing admin API (prices, budgets) and the tenant's budget view, through the real server."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import httpx
import openai
import pytest
from loraplex.billing.models import UsageEventRow
from sqlalchemy import select

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Name a colour."}]


def meter_of(server):
    return server.services.extensions.domain_state["billing"].meter


def call(server, method: str, path: str, label: str = "admin", **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.keys[label]}"}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=30, **kwargs)


def next_month_first() -> str:
    today = datetime.now(UTC).date()
    return date(today.year + today.month // 12, today.month % 12 + 1, 1).isoformat()


@pytest.fixture(scope="module")
def server(start_server):
    with start_server() as running:
        yield running


def test_a_price_added_over_the_api_prices_the_next_request_exactly(server):
    created = call(server, "POST", "/v1/admin/prices", json={
        "model": MODEL, "input": "2.5", "cached_input": 0.25, "output": 10, "thinking": "12.000001"})
    assert created.status_code == 201, created.text
    price = created.json()
    assert (price["input"], price["cached_input"], price["output"], price["thinking"]) == ("2.5", "0.25", "10",
                                                                                          "12.000001")
    assert price["in_force"] is True and price["adapter_id"] is None

    raw = server.client("all").chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0)
    usage = raw.parse().usage
    assert meter_of(server).wait_written()
    with server.services.db_sessions() as db:
        row = db.scalar(select(UsageEventRow).where(UsageEventRow.request_id == raw.headers["x-request-id"]))
    cached = usage.prompt_tokens_details.cached_tokens
    # micro-USD per million tokens x tokens = pico-USD, exactly
    expected = (usage.prompt_tokens - cached) * 2_500_000 + cached * 250_000 + usage.completion_tokens * 10_000_000
    assert row.price_id == price["id"] and row.cost_picousd == expected

    report = call(server, "GET", "/v1/usage", "usage", params={"group_by": "model"}).json()
    assert report["totals"]["cost_usd"] == pytest.approx(expected / 1e12)

    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    future = call(server, "POST", "/v1/admin/prices", json={
        "model": MODEL, "input": "3", "output": "11", "effective_from": later}).json()
    assert (future["in_force"], future["cached_input"], future["thinking"]) == (False, "3", "11")
    listed = call(server, "GET", "/v1/admin/prices", params={"model": MODEL}).json()["data"]
    assert [(p["id"], p["in_force"]) for p in listed[:2]] == [(future["id"], False), (price["id"], True)]
    assert call(server, "GET", "/v1/admin/prices", params={"model": "other-model"}).json()["data"] == []


def test_a_price_added_by_another_process_bills_from_its_effective_time(start_server):
    """The CLI (or another server) writes the book without touching this server's caches: costs follow anyway."""
    from loraplex.billing.pricing import add_price

    with start_server() as server:
        client = server.client("all")
        first = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert meter_of(server).wait_written()  # the ledger has read (and cached) the book without this price
        with server.services.db_sessions() as db, db.begin():
            added = add_price(db, model=MODEL, input_usd_per_mtok="1", output_usd_per_mtok="2")
        second = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert meter_of(server).wait_written()
        with server.services.db_sessions() as db:
            rows = {row.request_id: row for row in db.scalars(select(UsageEventRow))}
        before, after = rows[first.headers["x-request-id"]], rows[second.headers["x-request-id"]]
        usage = second.parse().usage
        assert (before.price_id, before.cost_picousd) == (None, 0)
        assert after.price_id == added.id
        assert after.cost_picousd == usage.prompt_tokens * 1_000_000 + usage.completion_tokens * 2_000_000


@pytest.mark.parametrize(("body", "param"), [
    ({"effective_from": "2020-01-01T00:00:00Z"}, "effective_from"),
    ({"input": "-1"}, "input"),
    ({"output": "0.0000001"}, "output"),
    ({"cached_input": 1e-7}, "cached_input"),
    ({"thinking": "ten"}, "thinking"),
    ({"input": None}, "input"),
    ({"input": "1e300000"}, "input"),
])
def test_bad_prices_are_refused_with_the_field_named(server, body, param):
    answer = call(server, "POST", "/v1/admin/prices", json={"model": MODEL, "input": "1", "output": "2", **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_prices_need_an_admin_key_and_a_real_adapter(server):
    body = {"model": MODEL, "input": "1", "output": "2"}
    assert call(server, "POST", "/v1/admin/prices", "usage", json=body).status_code == 403
    assert call(server, "GET", "/v1/admin/prices", "inference").status_code == 403
    missing = call(server, "POST", "/v1/admin/prices", json={**body, "adapter_id": "adp_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "adapter_id"


def test_budgets_enforce_show_and_lift(start_server):
    with start_server() as server:
        globex = server.tenants["globex"]
        put = call(server, "PUT", "/v1/admin/tenants/globex/budgets", json={"monthly_token_limit": 40})
        assert put.status_code == 200, put.text
        assert put.json()["monthly_token_limit"] == 40 and put.json()["scope"] == "tenant"
        client = server.client("globex")
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert meter_of(server).wait_written()
        with pytest.raises(openai.RateLimitError) as raised:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
        assert raised.value.body["code"] == "insufficient_quota"
        assert raised.value.response.json()["error"]["type"] == "rate_limit_error"

        admin_view = call(server, "GET", f"/v1/admin/tenants/{globex}/budgets").json()
        [budget] = admin_view["data"]
        assert budget["used_tokens"] >= 40 and budget["remaining_tokens"] == 0
        assert admin_view["resets_on"] == budget["resets_on"] == next_month_first()
        mine = call(server, "GET", "/v1/usage/budgets", "globex").json()
        assert mine == admin_view, "the tenant sees the same numbers as the operator"

        assert call(server, "DELETE", "/v1/admin/tenants/globex/budgets").status_code == 200
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)  # lifted at once
        gone = call(server, "DELETE", "/v1/admin/tenants/globex/budgets")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
        assert call(server, "GET", "/v1/usage/budgets", "globex").json()["data"] == []


def test_a_key_budget_binds_only_that_key_and_tenants_see_only_their_own(start_server):
    with start_server() as server:
        keys = server.key_ids
        for label, limit in (("inference", 0), ("usage", 1000)):
            body = {"api_key_id": keys[label], "monthly_token_limit": limit, "monthly_cost_limit_usd": "0.5"}
            assert call(server, "PUT", "/v1/admin/tenants/acme/budgets", json=body).status_code == 200
        with pytest.raises(openai.RateLimitError) as raised:
            server.client("inference").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert raised.value.body["code"] == "insufficient_quota" and keys["inference"] in raised.value.body["message"]
        server.client("all").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)

        everything = call(server, "GET", "/v1/admin/tenants/acme/budgets").json()["data"]
        assert {b["api_key_id"] for b in everything} == {keys["inference"], keys["usage"]}
        seen = call(server, "GET", "/v1/usage/budgets", "usage").json()
        assert [(b["api_key_id"], b["monthly_cost_limit_usd"], b["remaining_tokens"]) for b in seen["data"]] == [
            (keys["usage"], "0.5", 1000)]
        assert call(server, "GET", "/v1/usage/budgets", "globex").json()["data"] == []
        assert call(server, "GET", "/v1/usage/budgets", "inference").status_code == 403

        lifted = call(server, "DELETE", "/v1/admin/tenants/acme/budgets", params={"api_key_id": keys["inference"]})
        assert lifted.status_code == 200
        server.client("inference").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)


@pytest.mark.parametrize(("tenant", "body", "status", "param"), [
    ("nobody", {"monthly_token_limit": 5}, 404, "tenant"),
    ("acme", {"api_key_id": "key_nope", "monthly_token_limit": 5}, 404, "api_key_id"),
    ("acme", {"monthly_token_limit": -1}, 400, "monthly_token_limit"),
    ("acme", {"monthly_token_limit": 1.5}, 400, "monthly_token_limit"),
    ("acme", {"monthly_cost_limit_usd": "0.0000001"}, 400, "monthly_cost_limit_usd"),
    ("acme", {"monthly_cost_limit_usd": "-2"}, 400, "monthly_cost_limit_usd"),
    # past the 64-bit columns, or costly to scale (each was a 500 or seconds of CPU)
    ("acme", {"monthly_cost_limit_usd": "1e30"}, 400, "monthly_cost_limit_usd"),
    ("acme", {"monthly_cost_limit_usd": "1e999990"}, 400, "monthly_cost_limit_usd"),
    ("acme", {"monthly_token_limit": 10**19}, 400, "monthly_token_limit"),
])
def test_bad_budgets_are_refused(server, tenant, body, status, param):
    answer = call(server, "PUT", f"/v1/admin/tenants/{tenant}/budgets", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param


def test_another_tenants_key_is_not_found_and_budgets_need_admin(server):
    body = {"api_key_id": server.key_ids["globex"], "monthly_token_limit": 5}
    assert call(server, "PUT", "/v1/admin/tenants/acme/budgets", json=body).status_code == 404
    assert call(server, "PUT", "/v1/admin/tenants/acme/budgets", "usage", json=body).status_code == 403
    assert call(server, "GET", "/v1/admin/tenants/acme/budgets", "usage").status_code == 403


def test_with_metering_off_the_routes_still_write_the_database(start_server):
    with start_server(metering_enabled=False) as server:
        assert "billing" not in server.services.extensions.domain_state
        created = call(server, "POST", "/v1/admin/prices", json={"model": "*", "input": "1", "output": "2"})
        assert created.status_code == 201 and created.json()["in_force"] is True
        put = call(server, "PUT", "/v1/admin/tenants/acme/budgets", json={"monthly_cost_limit_usd": 3.25})
        assert put.json()["monthly_cost_limit_usd"] == "3.25" and put.json()["used_cost_usd"] == "0"
        assert call(server, "GET", "/v1/usage/budgets", "usage").json()["data"][0]["remaining_cost_usd"] == "3.25"
