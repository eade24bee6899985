"""The usage page for a tenant with data: totals, three charts, the table and the CSV download.

Today's usage comes from real requests through the openai client (metered by
the running app); earlier days are written to the same ledger with the
billing code, so the chart spans several days without waiting for them.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from adapter_upload import upload_adapter
from loraplex.billing.events import UsageEvent, UsageStatus
from loraplex.billing.ledger import Ledger
from loraplex.billing.pricing import PriceBook, add_price
from playwright.sync_api import expect
from portal_steps import sign_in
from waiting import wait_until

PAST_DAYS = {1: (1200, 300, 400, 0), 2: (800, 0, 250, 60), 4: (2500, 1200, 900, 200), 6: (400, 0, 120, 0)}


def write_past_usage(server) -> None:  # type: ignore[no-untyped-def]
    sessions = server.services.db_sessions
    now = datetime.now(UTC)
    with sessions() as db:
        add_price(db, model=server.services.base_model_name, input_usd_per_mtok="2", output_usd_per_mtok="8",
                  cached_input_usd_per_mtok="0.5", effective_from=now - timedelta(days=30))
        db.commit()
    events = [
        UsageEvent(
            request_id=f"req_past_{days}_{i}", tenant_id=server.tenants["acme"], model=server.services.base_model_name,
            status=UsageStatus.COMPLETED, created_at=now - timedelta(days=days), api_key_id=server.key_ids[key],
            input_tokens=tokens[0], cached_input_tokens=tokens[1], output_tokens=tokens[2], thinking_tokens=tokens[3],
        )
        for days, tokens in PAST_DAYS.items()
        for i, key in enumerate(("all", "inference", "inference"))
    ]
    Ledger(sessions, PriceBook(sessions)).write(events)


def set_budgets(server) -> dict:  # type: ignore[no-untyped-def]
    """A tenant-wide token budget and a cost budget on the page's key; returns what the tenant API reports."""
    admin = {"Authorization": f"Bearer {server.keys['admin']}"}
    url = f"{server.base_url}/v1/admin/tenants/acme/budgets"
    for body in ({"monthly_token_limit": 1_000_000},
                 {"api_key_id": server.key_ids["all"], "monthly_cost_limit_usd": "25"},
                 {"api_key_id": server.key_ids["inference"], "monthly_token_limit": 5}):  # not the page's key
        assert httpx.put(url, json=body, headers=admin, timeout=30).status_code == 200
    mine = {"Authorization": f"Bearer {server.keys['all']}"}
    return httpx.get(f"{server.base_url}/v1/usage/budgets", headers=mine, timeout=30).json()


def usage_report(server, days: int = 30, **params: str) -> httpx.Response:  # type: ignore[no-untyped-def]
    """The page's default range: the last `days` days, today included (UTC)."""
    today = datetime.now(UTC).date()
    query = {"start": (today - timedelta(days=days - 1)).isoformat(), "end": today.isoformat(), **params}
    headers = {"Authorization": f"Bearer {server.keys['usage']}"}
    return httpx.get(server.base_url + "/v1/usage", params=query, headers=headers, timeout=30)


def wait_for_requests(server, expected: int) -> dict:  # type: ignore[no-untyped-def]
    """The meter writes on its own thread; the report is current once every request is in."""
    def current() -> dict | None:
        report = usage_report(server, group_by="day").json()
        return report if report["totals"]["requests"] >= expected else None

    return wait_until(current, timeout_s=30, interval_s=0.2, what=f"{expected} requests in the usage report")


def test_usage_page_charts_table_and_csv(
    start_server, trained_adapters, new_page, artifacts_dir: Path  # type: ignore[no-untyped-def]
) -> None:
    with start_server() as server:
        write_past_usage(server)
        upload_adapter(server, "pirate", trained_adapters["pirate"], key_label="adapters", timeout_s=180)
        base = server.services.base_model_name
        for key, model in (("all", base), ("inference", base), ("inference", "pirate"), ("inference", "pirate")):
            server.client(key).chat.completions.create(
                model=model, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Name a colour."}],
            )
        expected_requests = 3 * len(PAST_DAYS) + 4
        report = wait_for_requests(server, expected_requests)
        assert report["totals"]["requests"] == expected_requests
        assert len(report["data"]) == len(PAST_DAYS) + 1
        budgets = set_budgets(server)
        tenant_budget = budgets["data"][0]
        assert tenant_budget["scope"] == "tenant" and tenant_budget["used_tokens"] > 0

        for viewport in ("desktop", "phone"):
            page, problems = new_page(viewport, accept_downloads=True)
            sign_in(page, server.base_url, server.keys["all"], then="/portal/usage")
            page.wait_for_selector("body[data-loaded]")
            expect(page.locator("#usage-error")).to_be_hidden()
            check_budget_panel(page, server, budgets)

            tiles = page.locator("#usage-totals .tile-value")
            expect(tiles.first).to_have_text(str(expected_requests))
            # one bar segment per non-zero class per day with data
            segments = sum(
                sum(1 for v in (row["input_tokens"] - row["cached_input_tokens"], row["cached_input_tokens"],
                                row["output_tokens"] - row["thinking_tokens"], row["thinking_tokens"]) if v > 0)
                for row in report["data"]
            )
            expect(page.locator("#chart-tokens rect.bar")).to_have_count(segments)
            expect(page.locator("#chart-tokens .legend li")).to_have_count(4)
            # the base model costs more (all past days), the adapter's id is shown by its name
            expect(page.locator("#chart-cost text.tick-label")).to_have_text(["base model", "pirate"])
            expect(page.locator("#chart-keys rect.bar")).to_have_count(2)
            expect(page.locator("#chart-keys text.tick-label").first).to_contain_text(server.key_ids["inference"][:8])

            rows = page.locator("#usage-body tr")
            expect(rows).to_have_count(len(report["data"]))
            expect(rows.first.locator("th")).to_have_text(report["data"][0]["day"])
            expect(page.locator("#requests-body tr")).to_have_count(expected_requests)  # one page holds them all
            expect(page.locator("#requests-summary")).to_contain_text(f"{expected_requests} of {expected_requests}")
            expect(page.locator("#requests-more")).to_be_hidden()
            # the two newest requests went to the adapter, shown by its name under the model
            expect(page.locator("#requests-body tr .cell-model .sub").first).to_have_text("pirate")
            expect(page.locator("#requests-body .cell-model .sub")).to_have_count(2)
            foot = page.locator("#usage-foot td")
            expect(foot.nth(0)).to_have_text(str(expected_requests))
            expect(foot.nth(1)).to_have_text(f"{report['totals']['input_tokens']:,}")
            page.screenshot(path=artifacts_dir / f"usage-{viewport}.png", full_page=True)

            with page.expect_download() as download_info:
                page.get_by_role("button", name="Download CSV").click()
            download = download_info.value
            assert download.suggested_filename.endswith(".csv")
            downloaded = Path(download.path()).read_text()
            assert downloaded == usage_report(server, group_by="day", format="csv").text
            lines = list(csv.DictReader(io.StringIO(downloaded)))
            assert [line["day"] for line in lines] == [row["day"] for row in report["data"]]
            assert sum(int(line["requests"]) for line in lines) == expected_requests
            if viewport == "desktop":
                check_date_range(page, today=report["end"])
            assert problems.messages == []


def check_budget_panel(page, server, budgets: dict) -> None:  # type: ignore[no-untyped-def]
    """The tenant's budget and this key's own, never another key's; a bar per limit and the reset date."""
    panel = page.locator("#budget-panel")
    expect(panel).to_be_visible()
    items = panel.locator("li.budget")
    expect(items).to_have_count(2)
    tenant = budgets["data"][0]
    tokens = items.nth(0).locator('.budget-meter[data-kind="tokens"]')
    expect(tokens.locator(".budget-used")).to_have_text(f"{tenant['used_tokens']:,} of 1,000,000 used")
    expect(tokens.locator(".budget-left")).to_have_text(f"{tenant['remaining_tokens']:,} left")
    expect(tokens.locator("progress")).to_be_visible()
    expect(items.nth(1).locator("h3")).to_contain_text(server.key_ids["all"])
    expect(items.nth(1).locator('.budget-meter[data-kind="cost"] .budget-used')).to_contain_text("of $25.00 used")
    expect(panel).not_to_contain_text(server.key_ids["inference"])
    resets = datetime.fromisoformat(budgets["resets_on"]).year
    expect(page.locator("#budget-resets")).to_contain_text(str(resets))


def check_date_range(page, today: str) -> None:  # type: ignore[no-untyped-def]
    """A one-day range shows one row; a reversed range is refused before asking the API."""
    page.get_by_label("From", exact=True).fill(today)
    page.get_by_label("To", exact=True).fill(today)
    page.get_by_role("button", name="Show").click()
    expect(page.locator("#usage-body tr")).to_have_count(1)
    expect(page.locator("#usage-body tr th")).to_have_text(today)
    expect(page.locator("#usage-totals .tile-value").first).to_have_text("4")
    assert page.url.endswith(f"?start={today}&end={today}")
    page.get_by_label("From", exact=True).fill("2026-12-31")
    page.get_by_label("To", exact=True).fill("2026-01-01")
    page.get_by_role("button", name="Show").click()
    expect(page.locator("#usage-error")).to_have_text("The start date is after the end date.")
    page.get_by_role("button", name="7 days").click()
    expect(page.locator("#usage-error")).to_be_hidden()
    expect(page.locator("#usage-body tr")).to_have_count(len(PAST_DAYS) + 1)  # every past day is within 7


def test_requests_table_loads_more_and_filters_by_session_or_request(start_server, new_page) -> None:  # type: ignore[no-untyped-def]
    """30 requests: a page of 25 newest first, Load more for the rest; a session id or a request id narrows it."""
    with start_server() as server:
        now = datetime.now(UTC)
        Ledger(server.services.db_sessions).write([
            UsageEvent(request_id=f"req_{i:03d}", tenant_id=server.tenants["acme"], model=server.services.base_model_name,
                       status=UsageStatus.COMPLETED, created_at=now - timedelta(seconds=i), api_key_id=server.key_ids["all"],
                       session_id="sess_demo" if i % 10 == 0 else None, input_tokens=10, output_tokens=i)
            for i in range(30)
        ])
        page, problems = new_page("desktop")
        sign_in(page, server.base_url, server.keys["all"], then="/portal/usage")
        page.wait_for_selector("body[data-loaded]")
        rows = page.locator("#requests-body tr")
        expect(rows).to_have_count(25)
        expect(rows.first).to_have_attribute("data-request-id", "req_000")
        expect(page.locator("#requests-summary")).to_contain_text("25 of 30 requests")
        page.get_by_role("button", name="Load more").click()
        expect(rows).to_have_count(30)
        expect(rows.last).to_have_attribute("data-request-id", "req_029")
        expect(page.get_by_role("button", name="Load more")).to_be_hidden()

        page.get_by_label("Request id or session id").fill("sess_demo")
        page.get_by_role("button", name="Find").click()
        expect(rows).to_have_count(3)
        expect(page.locator("#requests-summary")).to_contain_text("3 of 3 requests · 60 tokens")
        page.get_by_label("Request id or session id").fill("req_017")
        page.get_by_role("button", name="Find").click()
        expect(rows).to_have_count(1)
        expect(rows.first.locator("td").nth(4)).to_have_text("10")  # input tokens
        page.get_by_role("button", name="Clear").click()
        expect(rows).to_have_count(25)
        assert problems.messages == []
