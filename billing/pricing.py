"""The price book: which price is in force for an event, and what the event costs.

Prices are integers in micro-USD per million tokens, so the cost of an event
in pico-USD is exactly sum(tokens × price) with no rounding anywhere.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation

from loraplex.billing.events import UsageEvent
from loraplex.billing.models import PriceRow
from loraplex.billing.unavailable import UNAVAILABLE_ERRORS
from loraplex.engine.errors import InvalidRequestError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

ANY_MODEL = "*"
PICO_PER_USD = 10**12
MICRO_PER_USD = 10**6
MAX_USD_DECIMALS = 6           # micro-USD: the price book's unit
MAX_USD = 1_000_000            # any amount (a price per million tokens, a monthly budget): fits picousd in 64 bits
BACKDATE_GRACE = timedelta(seconds=5)  # clock skew between the operator's machine and ours


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
    """Prices from the database.

    Batch API requests cost the book's price less the batch discount (a setting,
    50% by default, as OpenAI's Batch API). The ledger reads the book afresh in
    every write transaction (`load`), so a
    stored cost always follows the book as it is stored, whichever process
    added a price. Estimates (the quota's prompt-cost check) use `prices()`,
    cached for `ttl_s`: the table is small and rarely written.
    """

    def __init__(self, session_factory: sessionmaker[Session], *, ttl_s: float = 30.0,
                 batch_discount_percent: int = 50) -> None:
        self._session_factory = session_factory
        self.batch_discount_percent = batch_discount_percent
        self._ttl_s = ttl_s
        self._prices: list[Price] = []
        self._loaded_at = -float("inf")
        self._ever_loaded = False
        self._lock = threading.Lock()

    def cost_picousd(self, price: Price, event: UsageEvent) -> int:
        """What the event costs at `price`: a Batch API request (`batch_id` set) at the batch price, the book's
        price less `batch_discount_percent` (rounded down to a whole pico-USD)."""
        cost = price.cost_picousd(event)
        if event.batch_id is None:
            return cost
        return cost * (100 - self.batch_discount_percent) // 100

    def invalidate(self) -> None:
        self._loaded_at = -float("inf")

    def prices(self) -> list[Price]:
        """The book as of at most `ttl_s` ago."""
        if time.monotonic() - self._loaded_at > self._ttl_s:
            try:
                with self._session_factory() as session:
                    return self.load(session)
            except UNAVAILABLE_ERRORS:
                # The database being down must not stop inference: admission prices its reservation with the
                # book last read (the ledger prices each event again when it stores it, once the database is back).
                if not self._ever_loaded:
                    raise
                log.warning("price book unavailable; using the one last read")
        return self._prices

    def load(self, session: Session) -> list[Price]:
        """The book as stored now, read in the caller's transaction (and cached for `prices()`)."""
        prices = [Price.from_row(row) for row in session.scalars(select(PriceRow))]
        with self._lock:
            self._prices, self._loaded_at, self._ever_loaded = prices, time.monotonic(), True
        return prices


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


def parse_usd(value: object, *, param: str) -> Decimal:
    """An amount of USD from the edge (API, CLI): non-negative, at most 6 decimal places, never rounded.

    JSON numbers arrive as floats; `Decimal(str(x))` keeps the digits the client wrote (0.1 stays 0.1).
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float | Decimal):
        raise InvalidRequestError(f"{param} must be a number of USD like \"0.15\"", param=param)
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise InvalidRequestError(f"{param} must be a number of USD like \"0.15\", not {value!r}", param=param) from None
    if not amount.is_finite():
        raise InvalidRequestError(f"{param} must be a finite number", param=param)
    if amount < 0:
        raise InvalidRequestError(f"{param} must not be negative", param=param)
    if amount > MAX_USD:  # before anything scales it: "1e300000" as an integer costs seconds of CPU
        raise InvalidRequestError(f"{param} must be at most {MAX_USD} USD", param=param)
    exponent = amount.normalize().as_tuple().exponent  # an int for every finite amount
    if isinstance(exponent, int) and -exponent > MAX_USD_DECIMALS:
        raise InvalidRequestError(
            f"{param} has more than {MAX_USD_DECIMALS} decimal places (the smallest unit is 1 micro-USD): {value}",
            param=param,
        )
    return amount


@dataclass(frozen=True, slots=True)
class NewPrice:
    """A validated price, in USD per million tokens, ready for `add_price`."""

    model: str
    adapter_id: str | None
    input: Decimal
    cached_input: Decimal
    output: Decimal
    thinking: Decimal
    effective_from: datetime

    def add_to(self, session: Session) -> PriceRow:
        return add_price(
            session, model=self.model, adapter_id=self.adapter_id, input_usd_per_mtok=self.input,
            output_usd_per_mtok=self.output, cached_input_usd_per_mtok=self.cached_input,
            thinking_usd_per_mtok=self.thinking, effective_from=self.effective_from,
        )


def validate_new_price(
    *,
    model: str,
    input_usd: object,
    output_usd: object,
    cached_input_usd: object | None = None,
    thinking_usd: object | None = None,
    adapter_id: str | None = None,
    effective_from: datetime | None = None,
    now: datetime | None = None,
) -> NewPrice:
    """Check a price given at the edge. A backdated price is refused: events already in the ledger
    were priced with the book as it was, so a new row in the past would make book and ledger disagree.
    """
    now = now or datetime.now(UTC)
    model = model.strip()
    if not model or len(model) > 200:
        raise InvalidRequestError("model must be a model name (1-200 characters) or '*' for any", param="model")
    if adapter_id is not None and not adapter_id.strip():
        raise InvalidRequestError("adapter_id must not be empty (omit it for any adapter)", param="adapter_id")
    input_price = parse_usd(input_usd, param="input")
    output_price = parse_usd(output_usd, param="output")
    if effective_from is None:
        effective_from = now
    elif effective_from.tzinfo is None:
        effective_from = effective_from.replace(tzinfo=UTC)  # naive times are UTC, like everything we store
    if effective_from < now - BACKDATE_GRACE:
        raise InvalidRequestError(
            f"effective_from {effective_from.isoformat()} is in the past: events already recorded were priced "
            "with the prices in force then; add the new price from now or a future date",
            param="effective_from",
        )
    return NewPrice(
        model=model,
        adapter_id=adapter_id,
        input=input_price,
        cached_input=input_price if cached_input_usd is None else parse_usd(cached_input_usd, param="cached_input"),
        output=output_price,
        thinking=output_price if thinking_usd is None else parse_usd(thinking_usd, param="thinking"),
        effective_from=effective_from,
    )


def list_prices(session: Session, *, model: str | None = None, adapter_id: str | None = None,
                now: datetime | None = None) -> list[tuple[Price, bool]]:
    """Every price row, newest first, each with whether it is in force now for its own (model, adapter)."""
    now = now or datetime.now(UTC)
    every = [Price.from_row(row) for row in session.scalars(select(PriceRow))]
    in_force = {
        price.id
        for price in every
        if (chosen := select_price(every, model=price.model, adapter_id=price.adapter_id, at=now)) is not None
        and chosen.id == price.id
    }
    shown = [
        p for p in every
        if (model is None or p.model == model) and (adapter_id is None or p.adapter_id == adapter_id)
    ]
    shown.sort(key=lambda p: (p.effective_from, p.id), reverse=True)
    return [(p, p.id in in_force) for p in shown]


def micro_to_usd(micro: int) -> Decimal:
    return Decimal(micro) / MICRO_PER_USD


def usd_text(amount: Decimal) -> str:
    """'0.15', '12', '0.000123456789': exact, no exponent, no trailing zeros."""
    return format(amount.normalize(), "f") if amount else "0"
