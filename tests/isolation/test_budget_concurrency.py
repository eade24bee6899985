"""A burst of concurrent requests against a small monthly budget, through the real API (no Redis: the
reservations live in the database): the tenant overspends by at most one request's reservation."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from waiting import wait_until

BUDGET_TOKENS = 300
MAX_TOKENS = 12
NUM_REQUESTS = 40


@pytest.fixture(scope="module")
def server(start_server):
    with start_server() as running:
        yield running


def test_concurrent_requests_overspend_by_at_most_one_reservation(server):
    admin = {"Authorization": f"Bearer {server.keys['admin']}"}
    set_budget = httpx.put(f"{server.base_url}/v1/admin/tenants/acme/budgets", headers=admin,
                           json={"monthly_token_limit": BUDGET_TOKENS})
    assert set_budget.status_code == 200, set_budget.text
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Count slowly:", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {server.keys['all']}"}

    def call(_: int) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=300)

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        replies = list(pool.map(call, range(NUM_REQUESTS)))
    served = [r.json()["usage"] for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(served) + len(refused) == NUM_REQUESTS, [r.text for r in replies if r.status_code not in (200, 429)]
    assert refused and all(r.json()["error"]["code"] == "insufficient_quota" for r in refused)
    reservation = served[0]["prompt_tokens"] + MAX_TOKENS
    billed = sum(u["total_tokens"] for u in served)
    assert BUDGET_TOKENS - reservation < billed <= BUDGET_TOKENS + reservation, (billed, len(served))

    # The ledger (what the tenant is charged) agrees once the meter has written every event.
    usage_key = {"Authorization": f"Bearer {server.keys['usage']}"}

    def tenant_used() -> int:
        budgets = httpx.get(f"{server.base_url}/v1/usage/budgets", headers=usage_key).json()["data"]
        return next(b["used_tokens"] for b in budgets if b["scope"] == "tenant")

    wait_until(lambda: tenant_used() == billed, timeout_s=30, interval_s=0.2,
               what=lambda: f"the ledger to show {billed} tokens used, not {tenant_used()}")
    late = call(0)
    assert late.status_code == 429 and late.json()["error"]["code"] == "insufficient_quota"
