"""The per-request log: over the ledger on SQLite and PostgreSQL (filters, order, keyset pages, totals), then
through the real server and the openai client (GET /v1/usage/requests[/{request_id}])."""

from __future__ import annotations

import base64
import csv
import io
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import httpx
import pytest
from loraplex.billing.ledger import Ledger
from loraplex.billing.pricing import PriceBook, add_price
from loraplex.billing.request_log import (
    REQUEST_COLUMNS,
    RequestLogQuery,
    encode_cursor,
    get_request,
    list_requests,
    requests_csv,
)
from loraplex.engine.errors import InvalidRequestError

NOON = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
TODAY = date(2026, 11, 26)


def query(tenant_id: str = "ten_a", **params) -> RequestLogQuery:
    return RequestLogQuery.parse(tenant_id=tenant_id, start=params.pop("start", "2026-11-01"), today=TODAY, **params)


def write(session_factory, events) -> None:
    with session_factory() as db, db.begin():
        add_price(db, model="*", input_usd_per_mtok="1", cached_input_usd_per_mtok="0.5", output_usd_per_mtok="2",
                  effective_from=datetime(2020, 1, 1, tzinfo=UTC))
    Ledger(session_factory, PriceBook(session_factory)).write(events)


def all_pages(session_factory, q: RequestLogQuery) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        with session_factory() as db:
            page = list_requests(db, RequestLogQuery.parse(
                tenant_id=q.tenant_id, start=q.start.isoformat(), end=q.end.isoformat(), session_id=q.session_id,
                limit=q.limit, cursor=cursor, today=TODAY))
        pages.append([row["request_id"] for row in page.rows])
        if not page.has_more:
            assert page.next_cursor is None
            return pages
        cursor = page.next_cursor


def test_newest_first_with_exact_cost_and_every_column(session_factory, make_event):
    write(session_factory, [make_event(f"r{i}", created_at=NOON + timedelta(minutes=i)) for i in range(3)])
    with session_factory() as db:
        page = list_requests(db, query())
    assert [row["request_id"] for row in page.rows] == ["r2", "r1", "r0"]
    assert not page.has_more and page.next_cursor is None
    row = page.rows[0]
    assert list(row) == list(REQUEST_COLUMNS)
    assert row["created_at"] == (NOON + timedelta(minutes=2)).isoformat()
    # 80 uncached input at $1/M, 20 cached at $0.5/M, 50 output at $2/M
    assert row["cost_usd"] == "0.00019"
    assert (row["input_tokens"], row["cached_input_tokens"], row["output_tokens"], row["thinking_tokens"],
            row["total_tokens"]) == (100, 20, 50, 10, 150)
    assert row["price_id"] is not None and row["adapter_id"] is None and row["ttft_ms"] == 12.5
    assert page.totals == {"requests": 3, "input_tokens": 300, "cached_input_tokens": 60, "output_tokens": 150,
                           "thinking_tokens": 30, "total_tokens": 450, "cost_usd": "0.00057"}


def test_filters_match_only_their_rows(session_factory, make_event):
    write(session_factory, [
        make_event("base", created_at=NOON),
        make_event("lora", created_at=NOON, adapter_id="adp_1", api_key_id="key_a2", session_id="ses_1"),
        make_event("cut", created_at=NOON, status="length", model="other", session_id="ses_1"),
        make_event("old", created_at=NOON - timedelta(days=30)),
        make_event("late", created_at=datetime(2026, 11, 25, 23, 59, 59, tzinfo=UTC)),
    ])

    def ids(**params) -> set[str]:
        with session_factory() as db:
            return {row["request_id"] for row in list_requests(db, query(**params)).rows}

    assert ids() == {"base", "lora", "cut", "late"}
    assert ids(adapter_id="base") == {"base", "cut", "late"}
    assert ids(adapter_id="adp_1") == {"lora"}
    assert ids(api_key_id="key_a2") == {"lora"}
    assert ids(session_id="ses_1") == {"lora", "cut"}
    assert ids(status="length") == {"cut"}
    assert ids(model="other") == {"cut"}
    assert ids(start="2026-10-21", end="2026-10-21") == {"old"}
    assert ids(start="2026-11-25", end="2026-11-25") == {"late"}  # the end day is inclusive to its last second
    with session_factory() as db:
        totals = list_requests(db, query(session_id="ses_1")).totals
    assert totals["requests"] == 2 and totals["output_tokens"] == 100 and totals["cost_usd"] == "0.00038"


def test_keyset_pages_over_equal_timestamps_have_no_gaps_or_repeats(session_factory, make_event):
    # 25 requests in 3 distinct instants: most page boundaries fall inside a run of equal created_at
    events = [make_event(f"r{i:02d}", created_at=NOON + timedelta(seconds=i // 10)) for i in range(25)]
    write(session_factory, events)
    with session_factory() as db:
        whole = list_requests(db, query(limit=1000))
    pages = all_pages(session_factory, query(limit=7))
    assert [len(p) for p in pages] == [7, 7, 7, 4]
    flat = [request_id for p in pages for request_id in p]
    assert flat == [row["request_id"] for row in whole.rows]
    assert sorted(flat) == sorted(e.request_id for e in events)
    # newest first: the three instants in descending order
    assert {r[:2] for r in flat[:5]} == {"r2"} and {r[:2] for r in flat[-10:]} == {"r0"}
    with session_factory() as db:  # totals are the whole set's on every page
        assert list_requests(db, query(limit=7)).totals["requests"] == 25


def test_rows_arriving_between_pages_do_not_shift_later_pages(session_factory, make_event):
    write(session_factory, [make_event(f"r{i}", created_at=NOON + timedelta(minutes=i)) for i in range(6)])
    with session_factory() as db:
        first = list_requests(db, query(limit=3))
    write(session_factory, [make_event("newer", created_at=NOON + timedelta(hours=1))])
    with session_factory() as db:
        second = list_requests(db, query(limit=3, cursor=first.next_cursor))
    assert [r["request_id"] for r in second.rows] == ["r2", "r1", "r0"] and not second.has_more


def test_tenants_never_see_each_others_requests(session_factory, make_event):
    write(session_factory, [make_event("mine", created_at=NOON), make_event("theirs", tenant_id="ten_b",
                                                                            created_at=NOON, session_id="ses_b")])
    with session_factory() as db:
        assert [r["request_id"] for r in list_requests(db, query()).rows] == ["mine"]
        assert list_requests(db, query(session_id="ses_b")).totals["requests"] == 0
        assert get_request(db, tenant_id="ten_a", request_id="theirs") is None
        assert get_request(db, tenant_id="ten_b", request_id="theirs")["session_id"] == "ses_b"
        assert get_request(db, tenant_id="ten_a", request_id="mine")["request_id"] == "mine"
        assert get_request(db, tenant_id="ten_a", request_id="nope") is None


def test_csv_has_the_json_columns_and_exact_costs(session_factory, make_event):
    write(session_factory, [make_event("r1", created_at=NOON, session_id="ses_1", ttft_ms=None)])
    with session_factory() as db:
        rows = list_requests(db, query()).rows
    lines = list(csv.DictReader(io.StringIO(requests_csv(rows))))
    assert list(lines[0]) == list(REQUEST_COLUMNS)
    assert lines[0]["cost_usd"] == "0.00019" and lines[0]["adapter_id"] == "" and lines[0]["ttft_ms"] == ""
    assert lines[0]["session_id"] == "ses_1" and lines[0]["created_at"] == NOON.isoformat()


@pytest.mark.parametrize(("params", "param"), [
    ({"start": "yesterday"}, "start"),
    ({"start": "2026-11-10", "end": "2026-11-01"}, "end"),
    ({"limit": 0}, "limit"),
    ({"limit": 1001}, "limit"),
    ({"limit": "ten"}, "limit"),
    ({"status": "done"}, "status"),
    ({"cursor": "not-a-cursor"}, "cursor"),
    ({"cursor": "!!!"}, "cursor"),
    ({"cursor": encode_cursor(NOON, 5)[:-3]}, "cursor"),
    # forged: a time that overflows when made UTC, a row id past BIGINT (each was a 500)
    ({"cursor": base64.urlsafe_b64encode(b"0001-01-01T00:00:00+01:00|5").decode()}, "cursor"),
    ({"cursor": base64.urlsafe_b64encode(b"2026-01-01T00:00:00+00:00|" + b"9" * 23).decode()}, "cursor"),
    ({"cursor": base64.urlsafe_b64encode("2026-01-01T00:00:00+00:00|²".encode()).decode()}, "cursor"),
])
def test_bad_input_names_its_parameter(params, param):
    with pytest.raises(InvalidRequestError) as raised:
        query(**params)
    assert raised.value.param == param


def test_defaults_are_this_month_and_100_rows():
    q = RequestLogQuery.parse(tenant_id="ten_a", today=TODAY)
    assert (q.start, q.end, q.limit, q.after) == (date(2026, 11, 1), TODAY, 100, None)
    assert RequestLogQuery.parse(tenant_id="t", cursor=encode_cursor(NOON, 7), today=TODAY).after == (NOON, 7)


# ---- through the real server and the openai client ------------------------------------------------

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(start_server):
    with start_server() as running:
        with running.services.db_sessions() as db, db.begin():
            add_price(db, model="*", input_usd_per_mtok="3", cached_input_usd_per_mtok="1", output_usd_per_mtok="7",
                      effective_from=datetime(2020, 1, 1, tzinfo=UTC))
        yield running


def api(server, label: str, path: str = "", **params) -> httpx.Response:
    meter = next(r.meter for r in server.services.extensions.usage_recorders if hasattr(r, "meter"))
    assert meter.wait_written()
    return httpx.get(f"{server.base_url}/v1/usage/requests{path}", params=params, timeout=30,
                     headers={"Authorization": f"Bearer {server.keys[label]}"})


def test_a_request_is_found_by_its_x_request_id_with_its_usage_and_cost(server):
    raw = server.client("all").chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=5, temperature=0)
    usage = raw.parse().usage
    request_id = raw.headers["x-request-id"]

    found = api(server, "usage", f"/{request_id}")
    assert found.status_code == 200, found.text
    row = found.json()
    assert (row["input_tokens"], row["cached_input_tokens"], row["output_tokens"], row["total_tokens"]) == (
        usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens, usage.total_tokens)
    uncached = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    expected = Decimal(3 * uncached + 1 * usage.prompt_tokens_details.cached_tokens + 7 * usage.completion_tokens)
    assert Decimal(row["cost_usd"]) == expected / 10**6
    assert row["api_key_id"] == server.key_ids["all"] and row["adapter_id"] is None and row["status"] == "length"
    assert row["created_at"].endswith("+00:00") and row["duration_ms"] > 0

    assert api(server, "globex", f"/{request_id}").status_code == 404  # another tenant: as if it did not exist
    missing = api(server, "usage", "/req_nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert api(server, "inference", f"/{request_id}").status_code == 403
    assert api(server, "admin", f"/{request_id}", tenant_id=server.tenants["acme"]).json()["cost_usd"] == row["cost_usd"]
    assert api(server, "admin", f"/{request_id}", tenant_id=server.tenants["globex"]).status_code == 404
    assert request_id not in {r["request_id"] for r in api(server, "globex").json()["data"]}


def test_a_sessions_requests_and_cost_are_listed_with_totals(server):
    created = httpx.post(f"{server.base_url}/v1/sessions", json={"model": MODEL}, timeout=30,
                         headers={"Authorization": f"Bearer {server.keys['all']}"})
    session_id = created.json()["id"]
    client = server.client("all")
    turns = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4,
                                            temperature=0, extra_body={"session_id": session_id})
             for text in ("Hi, I am Ada.", "What is my name?")]
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)  # outside the session

    listed = api(server, "usage", session_id=session_id).json()
    assert listed["object"] == "list" and not listed["has_more"] and listed["next_cursor"] is None
    assert len(listed["data"]) == 2 and {r["session_id"] for r in listed["data"]} == {session_id}
    assert listed["data"][0]["created_at"] >= listed["data"][1]["created_at"]
    totals = listed["totals"]
    assert totals["requests"] == 2
    assert totals["input_tokens"] == sum(t.usage.prompt_tokens for t in turns)
    assert totals["output_tokens"] == sum(t.usage.completion_tokens for t in turns)
    assert Decimal(totals["cost_usd"]) == sum(Decimal(r["cost_usd"]) for r in listed["data"])
    assert api(server, "globex", session_id=session_id).json()["totals"]["requests"] == 0

    first = api(server, "usage", limit=1).json()
    second = api(server, "usage", limit=1, cursor=first["next_cursor"]).json()
    assert first["has_more"] and first["data"][0]["request_id"] != second["data"][0]["request_id"]
    assert first["totals"] == second["totals"]

    as_csv = api(server, "usage", session_id=session_id, format="csv")
    assert as_csv.headers["content-type"].startswith("text/csv")
    assert as_csv.headers["content-disposition"].startswith('attachment; filename="requests-')
    lines = list(csv.DictReader(io.StringIO(as_csv.text)))
    assert [line["request_id"] for line in lines] == [r["request_id"] for r in listed["data"]]
    assert [line["cost_usd"] for line in lines] == [r["cost_usd"] for r in listed["data"]]


def test_scopes_admin_tenants_and_bad_input(server):
    server.client("globex").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert api(server, "inference").status_code == 403
    assert api(server, "globex", tenant_id=server.tenants["acme"]).status_code == 403
    as_admin = api(server, "admin", tenant_id=server.tenants["globex"]).json()
    assert as_admin["totals"]["requests"] >= 1 and {r["api_key_id"] for r in as_admin["data"]} == {
        server.key_ids["globex"]}
    assert api(server, "admin", tenant_id="*").json()["error"]["param"] == "tenant_id"
    for params, param in (({"start": "soon"}, "start"), ({"start": "2026-11-10", "end": "2026-11-01"}, "end"),
                          ({"limit": "0"}, "limit"), ({"limit": "1001"}, "limit"), ({"cursor": "xyz"}, "cursor"),
                          ({"status": "done"}, "status")):
        response = api(server, "usage", **params)
        assert response.status_code == 400, params
        assert response.json()["error"]["param"] == param
