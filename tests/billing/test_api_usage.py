"""Billing through the real server: one ledger row per request, /v1/usage reports, quotas as 429."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime

import httpx
import openai
import pytest
from loraplex.billing.models import UsageEventRow
from loraplex.billing.pricing import add_price
from loraplex.billing.quotas import set_budget
from sqlalchemy import select

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Name a colour."}]


def meter_of(server):
    return next(r.meter for r in server.services.extensions.usage_recorders if hasattr(r, "meter"))


def ledger_rows(server) -> dict[str, UsageEventRow]:
    assert meter_of(server).wait_written()
    with server.services.db_sessions() as db:
        return {row.request_id: row for row in db.scalars(select(UsageEventRow))}


def _get(server, label: str, **params) -> httpx.Response:
    return httpx.get(f"{server.base_url}/v1/usage", params=params,
                     headers={"Authorization": f"Bearer {server.keys[label]}"}, timeout=30)


@pytest.fixture(scope="module")
def server(start_server):
    with start_server() as running:
        yield running


def test_each_request_is_one_ledger_row_with_the_served_usage(server):
    client = server.client("all")
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0)
    answer = raw.parse()
    request_id = raw.headers["x-request-id"]
    row = ledger_rows(server)[request_id]
    assert (row.input_tokens, row.cached_input_tokens, row.output_tokens) == (
        answer.usage.prompt_tokens, answer.usage.prompt_tokens_details.cached_tokens, answer.usage.completion_tokens)
    assert row.tenant_id == server.tenants["acme"] and row.api_key_id == server.key_ids["all"]
    assert row.status == "length" and row.model == MODEL and row.adapter_id is None
    assert row.duration_ms > 0 and row.ttft_ms is not None


def test_a_scored_prompt_bills_its_input_and_no_output(server):
    """/v1/completions with echo and max_tokens 0: the token the engine samples after the prompt is not answered,
    so the ledger bills the prompt alone."""
    client = server.client("all")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Score this sentence.", max_tokens=0,
                                                      echo=True, logprobs=0)
    answer = raw.parse()
    row = ledger_rows(server)[raw.headers["x-request-id"]]
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens > 0
    assert (row.input_tokens, row.output_tokens) == (answer.usage.prompt_tokens, 0)


def test_a_token_past_the_vocabulary_is_refused_before_anything_is_billed(server):
    """A logit_bias token past the vocabulary is refused by the API server, which knows the tokenizer's size,
    before the request is queued or metered: a 400 naming the parameter, the engine's counters count
    nothing, and the ledger holds no row for it."""
    client = server.client("all")
    before = server.services.engine.stats()
    with pytest.raises(openai.BadRequestError) as bias:
        client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=2,
                                                         logit_bias={"999999": 1})
    with pytest.raises(openai.BadRequestError) as ids:
        client.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=2, logit_bias={"999999": 1})
    assert (bias.value.body["param"], ids.value.body["param"]) == ("logit_bias", "logit_bias")
    after = server.services.engine.stats()
    rows = ledger_rows(server)
    for error in (bias.value, ids.value):
        assert error.response.headers["x-request-id"] not in rows
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"]


def test_usage_report_json_csv_scopes_and_tenant_isolation(server):
    acme, globex = server.client("all"), server.client("globex")
    served = [acme.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0)
              for _ in range(3)]
    globex.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    ledger = ledger_rows(server)
    acme_rows = [r for r in ledger.values() if r.tenant_id == server.tenants["acme"]]
    assert len([r for r in ledger.values() if r.tenant_id == server.tenants["globex"]]) == 1
    assert sum(a.usage.completion_tokens for a in served) <= sum(r.output_tokens for r in acme_rows)

    report = _get(server, "usage", group_by="model").json()  # a key with only the usage scope
    assert report["tenant_id"] == server.tenants["acme"]
    assert report["totals"]["requests"] == len(acme_rows)
    assert report["totals"]["input_tokens"] == sum(r.input_tokens for r in acme_rows)
    assert report["totals"]["output_tokens"] == sum(r.output_tokens for r in acme_rows)
    assert [row["model"] for row in report["data"]] == [MODEL]

    by_key = _get(server, "usage", group_by="api_key", format="csv")
    assert by_key.headers["content-type"].startswith("text/csv")
    assert "attachment" in by_key.headers["content-disposition"]
    lines = list(csv.DictReader(io.StringIO(by_key.text)))
    assert {line["api_key"]: int(line["requests"]) for line in lines} == {
        key: sum(1 for r in acme_rows if r.api_key_id == key) for key in {r.api_key_id for r in acme_rows}}

    mine = _get(server, "globex", group_by="day").json()
    assert mine["totals"]["requests"] == 1
    assert _get(server, "globex", tenant_id=server.tenants["acme"]).status_code == 403
    assert _get(server, "inference").status_code == 403
    assert _get(server, "usage", group_by="colour").json()["error"]["param"] == "group_by"

    admin_view = _get(server, "admin", tenant_id=server.tenants["globex"]).json()
    assert admin_view["totals"]["requests"] == 1
    everyone = _get(server, "admin", tenant_id="*", group_by="tenant").json()
    assert {row["tenant"] for row in everyone["data"]} == {server.tenants["acme"], server.tenants["globex"]}


def test_spent_budget_refuses_with_429_before_queueing(start_server):
    with start_server() as server:
        with server.services.db_sessions() as db, db.begin():
            set_budget(db, tenant_id=server.tenants["globex"], monthly_token_limit=40)
        client = server.client("globex")
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert meter_of(server).wait_written()
        before = server.services.engine.stats()["prompt_tokens_total"]
        with pytest.raises(openai.RateLimitError) as raised:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
        error = raised.value.body
        assert error["code"] == "insufficient_quota"
        month = datetime.now(UTC).strftime("%Y-%m")
        assert f"of 40 tokens used in {month}" in error["message"] and "resets on" in error["message"]
        assert server.services.engine.stats()["prompt_tokens_total"] == before, "refused before the engine"
        server.client("all").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)  # acme unaffected


def test_a_prompt_that_would_overrun_a_budget_is_refused_before_the_engine(start_server):
    long_prompt = [{"role": "user", "content": "Repeat after me: " + "lorem ipsum " * 150}]
    with start_server() as server:
        with server.services.db_sessions() as db, db.begin():
            add_price(db, model="*", input_usd_per_mtok="2", cached_input_usd_per_mtok="1", output_usd_per_mtok="4",
                      effective_from=datetime(2020, 1, 1, tzinfo=UTC))
            set_budget(db, tenant_id=server.tenants["globex"], monthly_token_limit=250)
            set_budget(db, tenant_id=server.tenants["globex"], api_key_id=server.key_ids["globex"],
                       monthly_cost_limit_usd="0.0002")
        client = server.client("globex")
        before = server.services.engine.stats()["prompt_tokens_total"]
        with pytest.raises(openai.RateLimitError) as raised:
            client.chat.completions.create(model=MODEL, messages=long_prompt, max_tokens=1)
        error = raised.value.body
        assert error["code"] == "insufficient_quota"
        assert "prompt tokens would overrun the monthly token budget of tenant" in error["message"], error
        assert "0 of 250 tokens used" in error["message"] and "250 left" in error["message"], error
        assert server.services.engine.stats()["prompt_tokens_total"] == before, "refused before the engine"

        with server.services.db_sessions() as db, db.begin():  # tokens no longer bind; the key's $0.0002 does
            set_budget(db, tenant_id=server.tenants["globex"], monthly_token_limit=None)
        server.services.extensions.domain_state["billing"].guard.invalidate()
        with pytest.raises(openai.RateLimitError) as raised:  # ~330 tokens at $1/M (cached price) > $0.0002
            client.chat.completions.create(model=MODEL, messages=long_prompt, max_tokens=1)
        assert "would overrun the monthly cost budget of API key" in raised.value.body["message"], raised.value.body
        assert server.services.engine.stats()["prompt_tokens_total"] == before

        reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)  # ~40 tokens fit
        assert reply.usage.prompt_tokens < 100
        assert server.services.engine.stats()["prompt_tokens_total"] == before + reply.usage.prompt_tokens
