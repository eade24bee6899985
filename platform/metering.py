"""Billing wired into the platform: the end-of-request hook → UsageEvent → Meter, and the quota preparer.

The platform calls `MeteringRecorder.record` exactly once per admitted
request, in a `finally`, with the engine's final counts; this turns that
record into a `UsageEvent` and waits until the meter has it in a durable
journal (one Redis round trip or fsync, shared by every request that ends
meanwhile); the ledger write happens later, on the meter's thread. The
platform closes a generation before its last bytes go out, so an answered
request has always been metered. `QuotaPreparer` refuses a request with 429
before it is queued when its tenant's or key's monthly budget is spent.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loraplex.billing.events import UsageEvent
from loraplex.billing.ledger import UNAVAILABLE_ERRORS, Ledger
from loraplex.billing.meter import Meter
from loraplex.billing.pricing import PriceBook, select_price
from loraplex.billing.quotas import QuotaGuard, RedisSpendCounter, Spend
from loraplex.billing.spend_counters import SqlSpendCounter
from loraplex.billing.spool import FileSpool, RedisStreamSpool, Spool
from loraplex.platform.extensions import Extensions, PreparedRequest, RequestRecord
from loraplex.platform.settings import Settings
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)


def usage_event(record: RequestRecord, *, base_model: str) -> UsageEvent:
    """The billing event of one request. Counts are the engine's; inconsistent ones are clamped, never dropped."""
    input_tokens = max(record.num_prompt_tokens, 0)
    output_tokens = max(record.num_output_tokens, 0)
    cached = min(max(record.num_cached_tokens, 0), input_tokens)
    thinking = min(max(record.num_reasoning_tokens, 0), output_tokens)
    if (cached, thinking) != (record.num_cached_tokens, record.num_reasoning_tokens):
        log.warning("clamped inconsistent token counts of %s: %r", record.request_id, record)
    ttft = record.time_to_first_token_s
    return UsageEvent(
        request_id=record.request_id,
        tenant_id=record.tenant_id,
        api_key_id=record.key_id or None,
        model=base_model,
        adapter_id=record.adapter_id,
        session_id=record.session_id,
        status=str(record.status),
        created_at=datetime.fromtimestamp(record.started_at, UTC),
        input_tokens=input_tokens,
        cached_input_tokens=cached,
        output_tokens=output_tokens,
        thinking_tokens=thinking,
        ttft_ms=None if ttft is None else ttft * 1000.0,
        duration_ms=max(record.finished_at - record.started_at, 0.0) * 1000.0,
        user=record.user,
        batch_id=record.batch_id,
    )


class MeteringRecorder:
    """The platform's UsageRecorder: one UsageEvent per request, durable before this returns."""

    def __init__(self, meter: Meter, *, base_model: str) -> None:
        self.meter = meter
        self._base_model = base_model

    async def record(self, record: RequestRecord) -> None:
        await asyncio.wrap_future(self.meter.record(usage_event(record, base_model=self._base_model)))


class QuotaPreparer:
    """Refuses work once the monthly budget is spent (QuotaExceededError → 429), before anything is queued."""

    def __init__(self, guard: QuotaGuard) -> None:
        self.guard = guard

    async def __call__(self, prepared: PreparedRequest) -> None:
        """The pipeline's `quota` stage: it adds nothing, it only refuses."""
        if self.guard.is_known_unlimited(prepared.tenant_id):
            return  # the common case costs no I/O on the event loop
        await asyncio.to_thread(self.guard.check, tenant_id=prepared.tenant_id, api_key_id=prepared.key_id or None)


class QuotaAdmission:
    """Once the prompt is tokenized: reserves the request's maximum cost on its budgets, or refuses it (429).

    The reservation is the prompt at the input price plus every choice's
    max_tokens at the output (or thinking, if dearer) price; the meter settles
    it with the actual usage once the ledger has the request's event. A request
    whose prompt alone would overrun what is left is refused (its tokens are
    exact, its cost taken at the lower of the input and cached-input prices).
    """

    def __init__(self, guard: QuotaGuard, price_book: PriceBook, *, base_model: str) -> None:
        self.guard = guard
        self.price_book = price_book
        self._base_model = base_model

    async def __call__(self, prepared: PreparedRequest) -> None:
        if self.guard.is_known_unlimited(prepared.tenant_id):
            return
        await asyncio.to_thread(self._reserve, prepared)

    def _reserve(self, prepared: PreparedRequest) -> None:
        num_prompt_tokens = sum(len(p) for p in prepared.prompts)
        num_output_tokens = len(prepared.prompts) * prepared.sampling.n * prepared.sampling.max_tokens
        price = select_price(self.price_book.prices(), model=self._base_model,
                             adapter_id=prepared.model.adapter_id, at=datetime.now(UTC))
        if price is None:
            amount, floor = Spend(num_prompt_tokens + num_output_tokens), Spend(num_prompt_tokens)
        else:
            amount = Spend(num_prompt_tokens + num_output_tokens,
                           num_prompt_tokens * price.input + num_output_tokens * max(price.output, price.thinking))
            floor = Spend(num_prompt_tokens, num_prompt_tokens * min(price.input, price.cached_input))
        self.guard.reserve(request_id=prepared.request_id, tenant_id=prepared.tenant_id,
                           api_key_id=prepared.key_id or None, amount=amount, floor=floor)


@dataclass(frozen=True, slots=True)
class BillingDomain:
    """What the billing routes need at request time (`extensions.domain_state["billing"]`).

    Admin writes invalidate these caches, so a new budget (or the prompt-cost
    estimate's price) applies at once in this process; other processes pick it
    up within the caches' TTLs (5 s for budgets, 30 s for the estimate's
    prices). Stored costs never lag: the ledger reads prices in each write.
    """

    guard: QuotaGuard
    price_book: PriceBook
    meter: Meter


def build_spools(settings: Settings, redis_client: Any | None) -> list[Spool]:
    """Redis streams first when Redis is configured; local fsynced files always, as the last resort."""
    spools: list[Spool] = []
    if redis_client is not None:
        spools.append(RedisStreamSpool(redis_client, settings.redis_key_prefix, lease_s=settings.billing_journal_lease_s))
    spools.append(FileSpool(Path(settings.data_dir) / "billing-spool"))
    return spools


def install_billing(
    extensions: Extensions, settings: Settings, *, db_sessions: sessionmaker[Session], base_model: str
) -> Meter:
    """Register the meter (usage recorder), the quota preparer and the shutdown flush."""
    redis_client = _redis(settings)
    counter = RedisSpendCounter(redis_client, settings.redis_key_prefix) if redis_client else SqlSpendCounter(db_sessions)
    guard = QuotaGuard(db_sessions, counter, reservation_ttl_s=settings.budget_reservation_ttl_s)
    if redis_client is None:
        _reconcile_at_start(guard)
    price_book = PriceBook(db_sessions, batch_discount_percent=settings.batch_price_discount_percent)
    meter = Meter(
        Ledger(db_sessions, price_book),
        spools=build_spools(settings, redis_client),
        dead_letter=FileSpool(Path(settings.data_dir) / "billing-dead-letter"),
        on_recorded=guard.on_recorded,
        batch_size=settings.billing_batch_size,
        keep_alive_interval_s=min(1.0, settings.billing_journal_lease_s / 3),
        # Requests wait only for the journal; the ledger writer runs a pass (read the journal, one transaction,
        # settle budgets, acknowledge: several fsyncs and the GIL for its SQL) per linger, not per request.
        write_linger_s=0.25,
    )
    meter.start()
    extensions.usage_recorders.append(MeteringRecorder(meter, base_model=base_model))
    extensions.stages["quota"] = QuotaPreparer(guard)
    extensions.admission_checks.append(QuotaAdmission(guard, price_book, base_model=base_model))
    extensions.domain_state["billing"] = BillingDomain(guard=guard, price_book=price_book, meter=meter)

    async def flush_meter() -> None:
        await asyncio.to_thread(meter.close, 30.0)

    extensions.on_shutdown.append(flush_meter)
    return meter


def _reconcile_at_start(guard: QuotaGuard) -> None:
    """Without Redis the month's spend lives in the database; the ledger is the truth it is reset from
    (events a crashed server stored but never counted)."""
    try:
        guard.reconcile()
    except UNAVAILABLE_ERRORS:
        log.warning("the ledger is unreachable; budget spend is reconciled at the next start or beat run")


def _redis(settings: Settings) -> Any | None:
    if not settings.redis_url:
        return None
    import redis

    return redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
