"""Where budget spend and reservations live: Redis (Lua scripts, shared by every server), the database
(the default without Redis: survives restarts, shared by every process on it), or one process's memory.

Each counter keeps a month's recorded spend per (tenant, scope) and the
reservations of running requests, and implements `reserve` / `settle`
atomically (see billing/quotas.py for what they mean).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from loraplex.billing import budget_scripts
from loraplex.billing.budget_types import Refusal, ScopeHold, Settlement, Spend, refuses
from loraplex.billing.models import BudgetReservationRow, BudgetRow, BudgetSpendRow
from sqlalchemy import Table, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

COUNTER_TTL_S = 70 * 86400  # a month's counters outlive the month, then expire


class MemorySpendCounter:
    """One process's counters (tests, tools): the served platform uses Redis or the database."""

    def __init__(self) -> None:
        self._spend: dict[tuple[str, str, str], Spend] = {}
        self._held: dict[tuple[str, str], dict[str, tuple[Spend, float]]] = defaultdict(dict)
        self._lock = threading.Lock()

    def reserve(self, *, month: str, tenant_id: str, request_id: str, holds: list[ScopeHold], amount: Spend,
                floor: Spend, expires_at: float, now: float) -> Refusal | None:
        with self._lock:
            for hold in holds:
                held = self._held[tenant_id, hold.scope]
                for expired in [rid for rid, (_, until) in held.items() if until <= now]:
                    del held[expired]
                spent = self._spend.get((month, tenant_id, hold.scope), Spend())
                used = Spend(spent.tokens + sum(s.tokens for s, _ in held.values()),
                             spent.cost_picousd + sum(s.cost_picousd for s, _ in held.values()))
                refusal = refuses(hold.budget, used, floor)
                if refusal is not None:
                    return Refusal(hold.scope, refusal.used, refusal.by_cost)
            for hold in holds:
                self._held[tenant_id, hold.scope][request_id] = (amount, expires_at)
        return None

    def settle(self, settlements: list[Settlement]) -> None:
        for item in settlements:
            with self._lock:
                for scope in item.scopes:
                    self._held[item.tenant_id, scope].pop(item.request_id, None)
            for scope in item.scopes:
                self.add(item.month, item.tenant_id, scope, item.actual)

    def add(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        with self._lock:
            old = self._spend.get((month, tenant_id, scope), Spend())
            self._spend[month, tenant_id, scope] = Spend(old.tokens + spend.tokens, old.cost_picousd + spend.cost_picousd)

    def get(self, month: str, tenant_id: str, scope: str) -> Spend:
        return self._spend.get((month, tenant_id, scope), Spend())

    def set(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        with self._lock:
            self._spend[month, tenant_id, scope] = spend


class RedisSpendCounter:
    def __init__(self, client: Any, key_prefix: str) -> None:
        self._redis = client
        self._prefix = key_prefix
        self._reserve_script = client.register_script(budget_scripts.RESERVE)
        self._settle_script = client.register_script(budget_scripts.SETTLE)

    def _key(self, month: str, tenant_id: str, scope: str) -> str:
        return f"{self._prefix}billing:spend:{month}:{tenant_id}:{scope or '*'}"

    def add(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        key = self._key(month, tenant_id, scope)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hincrby(key, "tokens", spend.tokens)
        pipe.hincrby(key, "cost", spend.cost_picousd)
        pipe.expire(key, COUNTER_TTL_S)
        pipe.execute()

    def get(self, month: str, tenant_id: str, scope: str) -> Spend:
        tokens, cost = self._redis.hmget(self._key(month, tenant_id, scope), "tokens", "cost")
        return Spend(int(tokens or 0), int(cost or 0))

    def set(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        key = self._key(month, tenant_id, scope)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(key, mapping={"tokens": spend.tokens, "cost": spend.cost_picousd})
        pipe.expire(key, COUNTER_TTL_S)
        pipe.execute()

    def _hold_keys(self, month: str, tenant_id: str, scope: str) -> list[str]:
        held = f"{self._prefix}billing:held:{tenant_id}:{scope or '*'}"
        return [self._key(month, tenant_id, scope), held, held + ":expiry"]

    def reserve(self, *, month: str, tenant_id: str, request_id: str, holds: list[ScopeHold], amount: Spend,
                floor: Spend, expires_at: float, now: float) -> Refusal | None:
        keys = [k for hold in holds for k in self._hold_keys(month, tenant_id, hold.scope)]
        limits = [str(-1 if v is None else v) for hold in holds
                  for v in (hold.budget.token_limit, hold.budget.cost_limit_picousd)]
        ttl = max(int(expires_at - now) + 60, 60)
        result = self._reserve_script(keys=keys, args=[
            repr(now), repr(expires_at), request_id, ttl, amount.tokens, amount.cost_picousd,
            floor.tokens, floor.cost_picousd, *limits,
        ])
        if result == 0:
            return None
        index, by_cost, tokens, cost = (int(v) for v in result)
        return Refusal(holds[index - 1].scope, Spend(tokens, cost), by_cost=bool(by_cost))

    def settle(self, settlements: list[Settlement]) -> None:
        script = self._settle_script
        pipe = self._redis.pipeline(transaction=False)
        for item in settlements:
            keys = [k for scope in item.scopes for k in self._hold_keys(item.month, item.tenant_id, scope)]
            script(keys=keys, args=[item.request_id, item.actual.tokens, item.actual.cost_picousd, COUNTER_TTL_S],
                   client=pipe)
        pipe.execute()


class SqlSpendCounter:
    """Spend and reservations as database rows: the counter without Redis.

    Reserving takes the tenant's budget rows for update first (PostgreSQL: row
    locks; SQLite: the write lock), so concurrent reservations of one tenant,
    from any thread or process on this database, run one after another.
    """

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory

    def add(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        with self._session_factory() as session:
            self._add(session, month, tenant_id, scope, spend)
            session.commit()

    def get(self, month: str, tenant_id: str, scope: str) -> Spend:
        with self._session_factory() as session:
            row = session.get(BudgetSpendRow, (month, tenant_id, scope))
            return Spend() if row is None else Spend(row.tokens, row.cost_picousd)

    def set(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        with self._session_factory() as session:
            session.execute(self._upsert(session, month, tenant_id, scope, spend, increment=False))
            session.commit()

    def reserve(self, *, month: str, tenant_id: str, request_id: str, holds: list[ScopeHold], amount: Spend,
                floor: Spend, expires_at: float, now: float) -> Refusal | None:
        r = BudgetReservationRow
        with self._session_factory() as session:
            session.execute(update(BudgetRow).where(BudgetRow.tenant_id == tenant_id)
                            .values(tenant_id=BudgetRow.tenant_id))  # the lock: taken before anything is read
            session.execute(delete(r).where(r.tenant_id == tenant_id, r.expires_at <= now))
            for hold in holds:
                spent = session.get(BudgetSpendRow, (month, tenant_id, hold.scope))
                held_tokens, held_cost = session.execute(
                    select(func.coalesce(func.sum(r.tokens), 0), func.coalesce(func.sum(r.cost_picousd), 0))
                    .where(r.tenant_id == tenant_id, r.scope == hold.scope)
                ).one()
                used = Spend((spent.tokens if spent else 0) + int(held_tokens),
                             (spent.cost_picousd if spent else 0) + int(held_cost))
                refusal = refuses(hold.budget, used, floor)
                if refusal is not None:
                    session.rollback()
                    return Refusal(hold.scope, refusal.used, refusal.by_cost)
            session.execute(delete(r).where(r.request_id == request_id))
            session.add_all([
                r(request_id=request_id, scope=hold.scope, tenant_id=tenant_id, tokens=amount.tokens,
                  cost_picousd=amount.cost_picousd, expires_at=expires_at)
                for hold in holds
            ])
            session.commit()
        return None

    def settle(self, settlements: list[Settlement]) -> None:
        if not settlements:
            return
        with self._session_factory() as session:
            for tenant_id in sorted({item.tenant_id for item in settlements}):  # one order: no deadlocks
                session.execute(update(BudgetRow).where(BudgetRow.tenant_id == tenant_id)
                                .values(tenant_id=BudgetRow.tenant_id))  # reservations never see half a settle
            session.execute(delete(BudgetReservationRow).where(
                BudgetReservationRow.request_id.in_([item.request_id for item in settlements])))
            # One upsert per counter, not per request: a batch of a busy tenant's events is one or two
            # statements (building each costs the meter's thread, and the API server's event loop, the GIL).
            totals: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
            for item in settlements:
                for scope in item.scopes:
                    total = totals[item.month, item.tenant_id, scope]
                    total[0] += item.actual.tokens
                    total[1] += item.actual.cost_picousd
            for (month, tenant_id, scope), (tokens, cost) in sorted(totals.items()):
                self._add(session, month, tenant_id, scope, Spend(tokens, cost))
            session.commit()

    def _add(self, session: Session, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        session.execute(self._upsert(session, month, tenant_id, scope, spend, increment=True))

    @staticmethod
    def _upsert(session: Session, month: str, tenant_id: str, scope: str, spend: Spend, *, increment: bool) -> Any:
        dialect = session.get_bind().dialect.name
        insert = postgresql_insert if dialect == "postgresql" else sqlite_insert
        row = BudgetSpendRow.__table__
        if not isinstance(row, Table):  # a declarative class's table, typed only as some FromClause
            raise TypeError("BudgetSpendRow is not mapped to a table")
        statement = insert(row).values(month=month, tenant_id=tenant_id, scope=scope, tokens=spend.tokens,
                                       cost_picousd=spend.cost_picousd)
        new = statement.excluded
        values = ({"tokens": row.c.tokens + new.tokens, "cost_picousd": row.c.cost_picousd + new.cost_picousd}
                  if increment else {"tokens": new.tokens, "cost_picousd": new.cost_picousd})
        return statement.on_conflict_do_update(index_elements=["month", "tenant_id", "scope"], set_=values)
