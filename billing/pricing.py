"""The price book: which price is in force for an event, and what the event costs.

Prices are integers in micro-USD per million tokens, so the cost of an event
in pico-USD is exactly sum(tokens × price) with no rounding anywhere.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from loraplex.billing.events import UsageEvent
from loraplex.billing.models import PriceRow
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

ANY_MODEL = "*"
PICO_PER_USD = 10**12
MICRO_PER_USD = 10**6


def usd_to_micro(usd: Decimal | str | int) -> int:
    """`"0.15"` USD per million tokens → 150000. Floats are refused: they cannot say 0.1 exactly."""
    if isinstance(usd, float):
        raise TypeError("give prices as str or Decimal, not float")
    return int((Decimal(usd) * MICRO_PER_USD).to_integral_value())


def picousd_to_usd(picousd: int) -> Decimal:
    return Decimal(picousd) / PICO_PER_USD


def usd_to_picousd(usd: Decimal | str | int) -> int:
    if isinstance(usd, float):
        raise TypeError("give amounts as str or Decimal, not float")
    return int((Decimal(usd) * PICO_PER_USD).to_integral_value())


@dataclass(frozen=True, slots=True)
class Price:
    id: int
    model: str
    adapter_id: str | None
    input: int            # micro-USD per million tokens
    cached_input: int
    output: int
    thinking: int
    effective_from: datetime

    def cost_picousd(self, event: UsageEvent) -> int:
        uncached = event.input_tokens - event.cached_input_tokens
        answer = event.output_tokens - event.thinking_tokens
        return (
            uncached * self.input
            + event.cached_input_tokens * self.cached_input
            + answer * self.output
            + event.thinking_tokens * self.thinking
        )

    @classmethod
    def from_row(cls, row: PriceRow) -> Price:
        effective = row.effective_from
        if effective.tzinfo is None:  # SQLite returns naive datetimes; we store UTC
            effective = effective.replace(tzinfo=UTC)
        return cls(
            id=row.id,
            model=row.model,
            adapter_id=row.adapter_id,
            input=row.input_micro_usd_per_mtok,
            cached_input=row.cached_input_micro_usd_per_mtok,
            output=row.output_micro_usd_per_mtok,
            thinking=row.thinking_micro_usd_per_mtok,
            effective_from=effective,
        )


def select_price(prices: list[Price], *, model: str, adapter_id: str | None, at: datetime) -> Price | None:
    """The most specific price in force at `at`: exact model beats "*", exact adapter beats any."""
    best: Price | None = None
    best_rank: tuple[int, int, datetime] | None = None
    for price in prices:
        if price.effective_from > at:
            continue
        if price.model not in (model, ANY_MODEL):
            continue
        if price.adapter_id is not None and price.adapter_id != adapter_id:
            continue
        rank = (int(price.model == model), int(price.adapter_id is not None), price.effective_from)
        if best_rank is None or rank > best_rank:
            best, best_rank = price, rank
    return best


class PriceBook:
    """Prices loaded from the database, cached for `ttl_s` (the table is small and rarely written)."""

    def __init__(self, session_factory: sessionmaker[Session], *, ttl_s: float = 30.0) -> None:
        self._session_factory = session_factory
        self._ttl_s = ttl_s
        self._prices: list[Price] = []
        self._loaded_at = -float("inf")
        self._lock = threading.Lock()

    def invalidate(self) -> None:
        self._loaded_at = -float("inf")

    def prices(self, session: Session | None = None) -> list[Price]:
        with self._lock:
            if time.monotonic() - self._loaded_at > self._ttl_s:
                if session is None:
                    with self._session_factory() as own:
                        self._prices = self._load(own)
                else:
                    self._prices = self._load(session)
                self._loaded_at = time.monotonic()
            return self._prices

    def price_for(self, event: UsageEvent, session: Session | None = None) -> Price | None:
        return select_price(
            self.prices(session), model=event.model, adapter_id=event.adapter_id, at=event.created_at
        )

    @staticmethod
    def _load(session: Session) -> list[Price]:
        return [Price.from_row(row) for row in session.scalars(select(PriceRow))]


def add_price(
    session: Session,
    *,
    model: str,
    input_usd_per_mtok: Decimal | str,
    output_usd_per_mtok: Decimal | str,
    cached_input_usd_per_mtok: Decimal | str | None = None,
    thinking_usd_per_mtok: Decimal | str | None = None,
    adapter_id: str | None = None,
    effective_from: datetime | None = None,
) -> PriceRow:
    """Add a price row (prices are never edited in place: a change is a new row with a later date).

    Cached input defaults to the input price and thinking to the output price.
    """
    row = PriceRow(
        model=model,
        adapter_id=adapter_id,
        input_micro_usd_per_mtok=usd_to_micro(input_usd_per_mtok),
        cached_input_micro_usd_per_mtok=usd_to_micro(
            input_usd_per_mtok if cached_input_usd_per_mtok is None else cached_input_usd_per_mtok
        ),
        output_micro_usd_per_mtok=usd_to_micro(output_usd_per_mtok),
        thinking_micro_usd_per_mtok=usd_to_micro(
            output_usd_per_mtok if thinking_usd_per_mtok is None else thinking_usd_per_mtok
        ),
        effective_from=effective_from or datetime.now(UTC),
    )
    session.add(row)
    session.flush()
    return row
