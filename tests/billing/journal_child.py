"""A process that meters events while its database refuses them, says so, then waits to be SIGKILLed.

Run by test_meter.py as `python journal_child.py file|redis <dir-or-redis-url> <key-prefix> <n>`; the
events it prints as durable must reach the ledger through whichever process starts next.
"""

from __future__ import annotations

import sys
import time
import uuid
from datetime import UTC, datetime

from loraplex.billing.events import UsageEvent, UsageStatus
from loraplex.billing.ledger import Ledger
from loraplex.billing.meter import Meter
from loraplex.billing.spool import FileSpool, RedisStreamSpool
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

REFUSING_URL = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere?connect_timeout=2"


def main() -> None:
    kind, where, key_prefix, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if kind == "file":
        spool = FileSpool(where)
    else:
        import redis

        spool = RedisStreamSpool(redis.Redis.from_url(where), key_prefix, lease_s=0.5)
    meter = Meter(Ledger(sessionmaker(create_engine(REFUSING_URL))), spools=[spool], retry_interval_s=0.05,
                  keep_alive_interval_s=0.1)
    meter.start()
    futures = [meter.record(UsageEvent(
        request_id=f"killed-{i}-{uuid.uuid4().hex[:6]}", tenant_id="ten_a", model="smollm2",
        status=UsageStatus.COMPLETED, created_at=datetime.now(UTC), api_key_id="key_a1",
        input_tokens=100, cached_input_tokens=10, output_tokens=50, thinking_tokens=5)) for i in range(count)]
    for future in futures:
        future.result(timeout=30)
    print("durable", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
